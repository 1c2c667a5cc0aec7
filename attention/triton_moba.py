"""MoBA (attention/moba.py) in Triton: each query attends only to the key blocks it selected (§11 of
docs/flash_attention.md).

Queries next to each other select different blocks, so a tile of consecutive queries would have to
visit the union of their selections, which for a long sequence is nearly every block. Instead the
work is organised by key block: for each block, the list of queries that selected it is gathered
(an "entry" is one (query, slot) pair of the selection), and a program attends one tile of gathered
queries to that block. A query's topk + 1 blocks are handled by different programs, each leaving a
partial result (output and log-sum-exp, §4) in the query's slot; a merge by log-sum-exp combines
them, the same rescaling as the online softmax (§2), done once across slots instead of per tile.

Kernels (reusing the dense kernels' tile functions from triton_flash.py):
  _moba_fwd        a program per (key block, tile of its entries): partial out + lse per entry
  _moba_bwd_dq     the same programs: dQ per entry, summed over a query's slots afterwards
  _moba_bwd_dkdv   a program per (key tile, batch*kv_head): dK, dV from every entry of its block,
                   over the GQA group (§7), no atomics
Each query always selects its own block, under the causal mask: within a block's list those entries
come first (entries are sorted by query), so only the first tiles of a list and the last, ragged one
are masked; the rest see the whole block.
"""
import torch
import triton
import triton.language as tl

from . import triton_flash
from .triton_flash import (
    LN2,
    LOG2E,
    _dkdv_tile,
    _dq_tile,
    _fwd_tile,
    _head_base,
    _load_rows,
    candidate_tiles,
)


# ---------------------------------------------------------------------------------------------
# Host side: the entry lists (plain PyTorch, no host sync)
# ---------------------------------------------------------------------------------------------
def entry_lists(selection: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """selection (B, H, T, S) block ids (-1 = empty slot) -> per (batch*head):
    order (BH, T*S) int32: entry ids t*S + slot grouped by key block, ascending query within a block
        (empty slots last);
    first, count (BH, n_blocks) int32: where each block's entries start in order, and how many."""
    B, H, T, S = selection.shape
    n_blocks = -(-T // block_size)
    chosen = selection.reshape(B * H, T * S)
    block = torch.where(chosen >= 0, chosen, n_blocks)  # empty slots sort into an extra block at the end
    entry = torch.arange(T * S, device=selection.device)
    order = (block * (T * S) + entry).argsort(dim=-1)
    count = torch.zeros(B * H, n_blocks + 1, dtype=torch.int64, device=selection.device)
    count.scatter_add_(1, block, torch.ones_like(block))
    count = count[:, :n_blocks]
    first = count.cumsum(1) - count
    return order.to(torch.int32), first.to(torch.int32).contiguous(), count.to(torch.int32).contiguous()


def work_items(count: torch.Tensor, T: int, S: int, block_m: int) -> torch.Tensor:
    """(n_items, 2) int32 [block list index bh * n_blocks + block, tile of that list] for every tile of
    block_m entries, plus padding items (index >= BH * n_blocks) that do nothing. The number of tiles
    depends on the selection, which lives on the GPU; launching a bound on it, ceil(T*S / block_m) +
    n_blocks per batch*head, instead of reading the exact number back keeps the call free of host syncs."""
    BH, n_blocks = count.shape
    tiles = (count.long() + block_m - 1) // block_m  # (BH, n_blocks)
    ends = tiles.flatten().cumsum(0)  # exclusive prefix: ends - tiles
    n_items = BH * (-(-T * S // block_m) + n_blocks)
    item = torch.arange(n_items, device=count.device)
    lists = torch.searchsorted(ends, item, right=True)  # the block list each item falls in
    inside = lists.clamp(max=BH * n_blocks - 1)
    tile = item - (ends[inside] - tiles.flatten()[inside])
    return torch.stack([lists, tile], 1).to(torch.int32).contiguous()


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _entry_tile(WORK, ORDER, FIRST, COUNT, n_lists, n_blocks, T, S,
                MOBA_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """The work item of this program -> (batch*head, key block, its gathered entries (M,), their query
    positions (M,) (T for padding rows, so row-checked loads read 0), which rows are real, and whether
    the tile needs the causal mask: it holds queries of the block itself, which come first in a list)."""
    item = tl.load(WORK + tl.program_id(0) * 2)
    tile = tl.load(WORK + tl.program_id(0) * 2 + 1)
    real = item < n_lists
    item = tl.where(real, item, 0)
    bh, block = item // n_blocks, item % n_blocks
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (M,)
    count = tl.where(real, tl.load(COUNT + item), 0)
    valid = rows < count
    entry = tl.load(ORDER + bh.to(tl.int64) * T * S + tl.load(FIRST + item) + rows, mask=valid, other=0)  # (M,)
    q_pos = tl.where(valid, entry // S, T)
    own_queries = tl.minimum(MOBA_BLOCK, T - block * MOBA_BLOCK)
    return bh, block, entry, q_pos, valid, tile * BLOCK_M < own_queries


@triton.jit
def _moba_fwd(Q, K, V, O_PART, LSE_PART, WORK, ORDER, FIRST, COUNT,
              stride_qb, stride_qh, stride_qt, stride_qd,
              stride_kb, stride_kh, stride_kt, stride_kd,
              stride_vb, stride_vh, stride_vt, stride_vd,
              H, GROUP, T, S, n_lists, n_blocks, scale,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MOBA_BLOCK: tl.constexpr,
              DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh, block, entry, q_pos, valid, causal = _entry_tile(WORK, ORDER, FIRST, COUNT, n_lists, n_blocks, T, S,
                                                         MOBA_BLOCK, BLOCK_M)
    b, h = bh // H, bh % H
    K = _head_base(K, b, h // GROUP, stride_kb, stride_kh)  # §7
    V = _head_base(V, b, h // GROUP, stride_vb, stride_vh)
    cols = tl.arange(0, BLOCK_D)  # (D,)
    q = _load_rows(_head_base(Q, b, h, stride_qb, stride_qh), q_pos, T, stride_qt, cols, stride_qd,
                   HEAD_DIM, True)  # (M, D): gathered rows
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E

    start = block * MOBA_BLOCK
    end = tl.minimum(start + MOBA_BLOCK, T)
    if causal:  # the block's own queries (and the last block's ragged end, which only they read)
        for start_n in range(start, end, BLOCK_N):
            k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
            visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < T)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, k_pos, stride_kt, stride_kd, stride_vt, stride_vd,
                                      cols, T, qk_scale, visible, HEAD_DIM, DOT_PRECISION)
    else:  # queries after the block see all of it; a past block is never cut off by T
        for start_n in range(start, end, BLOCK_N):
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, start_n + tl.arange(0, BLOCK_N), stride_kt, stride_kd,
                                      stride_vt, stride_vd, cols, T, qk_scale, None, HEAD_DIM, DOT_PRECISION)

    # every entry sees at least one key (its own query's block holds the query itself), so l > 0
    out_rows = bh.to(tl.int64) * T * S + entry  # (M,) the entries' slots
    tl.store(O_PART + out_rows[:, None] * BLOCK_D + cols[None, :], acc / l_i[:, None], mask=valid[:, None])
    tl.store(LSE_PART + out_rows, (m_i + tl.log2(l_i)) * LN2, mask=valid)


@triton.jit
def _moba_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ_PART, WORK, ORDER, FIRST, COUNT,
                 stride_qb, stride_qh, stride_qt, stride_qd,
                 stride_kb, stride_kh, stride_kt, stride_kd,
                 stride_vb, stride_vh, stride_vt, stride_vd,
                 stride_dob, stride_doh, stride_dot, stride_dod,
                 H, GROUP, T, S, n_lists, n_blocks, scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MOBA_BLOCK: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh, block, entry, q_pos, valid, causal = _entry_tile(WORK, ORDER, FIRST, COUNT, n_lists, n_blocks, T, S,
                                                         MOBA_BLOCK, BLOCK_M)
    b, h = bh // H, bh % H
    K = _head_base(K, b, h // GROUP, stride_kb, stride_kh)
    V = _head_base(V, b, h // GROUP, stride_vb, stride_vh)
    cols = tl.arange(0, BLOCK_D)
    q = _load_rows(_head_base(Q, b, h, stride_qb, stride_qh), q_pos, T, stride_qt, cols, stride_qd, HEAD_DIM, True)
    do = _load_rows(_head_base(DO, b, h, stride_dob, stride_doh), q_pos, T, stride_dot, cols, stride_dod,
                    HEAD_DIM, True)  # (M, D)
    # the merged (final) log-sum-exp and Delta of each query: P over this block is exp(s - lse) of the
    # whole row, so the partial dQ of each slot adds up to the row's dQ (§5)
    lse2 = tl.load(LSE + bh.to(tl.int64) * T + q_pos, mask=valid, other=float("inf")) * LOG2E  # (M,)
    delta = tl.load(DELTA + bh.to(tl.int64) * T + q_pos, mask=valid, other=0.0)  # (M,)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E

    start = block * MOBA_BLOCK
    end = tl.minimum(start + MOBA_BLOCK, T)
    if causal:
        for start_n in range(start, end, BLOCK_N):
            k_pos = start_n + tl.arange(0, BLOCK_N)
            visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < T)
            dq = _dq_tile(dq, q, do, lse2, delta, K, V, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols,
                          T, qk_scale, visible, HEAD_DIM, DOT_PRECISION)
    else:
        for start_n in range(start, end, BLOCK_N):
            dq = _dq_tile(dq, q, do, lse2, delta, K, V, start_n + tl.arange(0, BLOCK_N), stride_kt, stride_kd,
                          stride_vt, stride_vd, cols, T, qk_scale, None, HEAD_DIM, DOT_PRECISION)
    out_rows = bh.to(tl.int64) * T * S + entry
    tl.store(DQ_PART + out_rows[:, None] * BLOCK_D + cols[None, :], dq * scale, mask=valid[:, None])


@triton.jit
def _moba_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, ORDER, FIRST, COUNT,
                   stride_qb, stride_qh, stride_qt, stride_qd,
                   stride_kb, stride_kh, stride_kt, stride_kd,
                   stride_vb, stride_vh, stride_vt, stride_vd,
                   stride_dob, stride_doh, stride_dot, stride_dod,
                   stride_dkb, stride_dkh, stride_dkt, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvt, stride_dvd,
                   H, GROUP, T, S, n_blocks, scale,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MOBA_BLOCK: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh_kv = tl.program_id(1)
    H_kv = H // GROUP
    b, h_kv = bh_kv // H_kv, bh_kv % H_kv
    block = start_n // MOBA_BLOCK

    k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
    cols = tl.arange(0, BLOCK_D)
    k = _load_rows(_head_base(K, b, h_kv, stride_kb, stride_kh), k_pos, T, stride_kt, cols, stride_kd, HEAD_DIM, True)
    v = _load_rows(_head_base(V, b, h_kv, stride_vb, stride_vh), k_pos, T, stride_vt, cols, stride_vd, HEAD_DIM, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E
    own_queries = tl.minimum(MOBA_BLOCK, T - block * MOBA_BLOCK)

    for g in range(GROUP):  # §7 GQA gradient sum, as in the dense dK/dV kernel
        bh = b * H + h_kv * GROUP + g
        Qh = _head_base(Q, b, h_kv * GROUP + g, stride_qb, stride_qh)
        DOh = _head_base(DO, b, h_kv * GROUP + g, stride_dob, stride_doh)
        LSEh = LSE + bh.to(tl.int64) * T
        DELTAh = DELTA + bh.to(tl.int64) * T
        item = bh * n_blocks + block
        entries = ORDER + bh.to(tl.int64) * T * S + tl.load(FIRST + item)
        count = tl.load(COUNT + item)
        # tiles of this block's entries: [0, causal_end) hold its own queries (causal mask),
        # [causal_end, full_end) see the whole key tile, [full_end, end) is the ragged last tile
        causal_end = tl.minimum(tl.cdiv(own_queries, BLOCK_M) * BLOCK_M, count)
        full_end = tl.maximum(count // BLOCK_M * BLOCK_M, causal_end)
        for rows in range(0, causal_end, BLOCK_M):
            dk, dv = _moba_dkdv_masked(dk, dv, k, v, k_pos, Qh, DOh, LSEh, DELTAh, entries, rows, count, T, S,
                                       stride_qt, stride_qd, stride_dot, stride_dod, cols, qk_scale,
                                       HEAD_DIM, DOT_PRECISION, BLOCK_M)
        for rows in range(causal_end, full_end, BLOCK_M):
            q_pos = tl.load(entries + rows + tl.arange(0, BLOCK_M)) // S  # (M,) all real
            dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, q_pos, stride_qt, stride_qd, stride_dot,
                                stride_dod, cols, T, qk_scale, None, HEAD_DIM, DOT_PRECISION)
        for rows in range(full_end, count, BLOCK_M):
            dk, dv = _moba_dkdv_masked(dk, dv, k, v, k_pos, Qh, DOh, LSEh, DELTAh, entries, rows, count, T, S,
                                       stride_qt, stride_qd, stride_dot, stride_dod, cols, qk_scale,
                                       HEAD_DIM, DOT_PRECISION, BLOCK_M)

    DK = _head_base(DK, b, h_kv, stride_dkb, stride_dkh)
    DV = _head_base(DV, b, h_kv, stride_dvb, stride_dvh)
    triton_flash._store_rows(DK, dk * scale, k_pos, T, stride_dkt, cols, stride_dkd, HEAD_DIM)
    triton_flash._store_rows(DV, dv, k_pos, T, stride_dvt, cols, stride_dvd, HEAD_DIM)


@triton.jit
def _moba_dkdv_masked(dk, dv, k, v, k_pos, Q, DO, LSE, DELTA, entries, rows, count, T, S,
                      stride_qt, stride_qd, stride_dot, stride_dod, cols, qk_scale,
                      HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    """One tile of gathered entries that needs the mask: causal, and padding rows past the list."""
    valid = rows + tl.arange(0, BLOCK_M) < count  # (M,)
    q_pos = tl.where(valid, tl.load(entries + rows + tl.arange(0, BLOCK_M), mask=valid, other=0) // S, T)
    visibleT = (k_pos[:, None] <= q_pos[None, :]) & (k_pos[:, None] < T) & valid[None, :]  # (N, M)
    return _dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, q_pos, stride_qt, stride_qd, stride_dot, stride_dod, cols,
                      T, qk_scale, visibleT, HEAD_DIM, DOT_PRECISION)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------
def _tile(kernel: str, q: torch.Tensor) -> tuple:
    # one fixed tile per kernel (the first candidate): the work list is cut in tiles of BLOCK_M entries,
    # so timing candidates per call would rebuild it for each; the block size is a multiple of every tile
    return candidate_tiles(kernel, triton.next_power_of_2(q.shape[-1]), q.dtype.itemsize)[0]


def _constants(q: torch.Tensor, block_size: int) -> dict:
    return {"HEAD_DIM": q.shape[-1], "BLOCK_D": triton.next_power_of_2(q.shape[-1]), "MOBA_BLOCK": block_size,
            "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32"}


def forward(q, k, v, selection, block_size: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> out (B, H, T, D), lse (B, H, T) float32 of the merged selection."""
    B, H, T, D = q.shape
    S = selection.shape[-1]
    block_d = triton.next_power_of_2(D)
    order, first, count = entry_lists(selection, block_size)
    block_m, block_n, warps, stages = _tile("fwd", q)
    work = work_items(count, T, S, block_m)
    # one partial result per (query, slot); slots no block filled keep lse = -inf and weigh 0 below
    o_part = torch.zeros(B, H, T, S, block_d, dtype=torch.float32, device=q.device)
    lse_part = torch.full((B, H, T, S), float("-inf"), dtype=torch.float32, device=q.device)
    _moba_fwd[(work.shape[0],)](q, k, v, o_part, lse_part, work, order, first, count,
                                *q.stride(), *k.stride(), *v.stride(),
                                H, H // k.shape[1], T, S, count.numel(), count.shape[1], scale,
                                **_constants(q, block_size), BLOCK_M=block_m, BLOCK_N=block_n,
                                num_warps=warps, num_stages=stages)
    # §11 merge the slots: lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s
    lse = torch.logsumexp(lse_part, dim=-1)  # (B, H, T)
    weight = torch.exp(lse_part - lse[..., None])  # (B, H, T, S)
    out = torch.einsum("bhts,bhtsd->bhtd", weight, o_part[..., :D])
    o = triton_flash.empty_bthd(B, H, T, D, q)
    o.copy_(out)
    return o, lse


def backward(do, q, k, v, o, lse, selection, block_size: int, scale: float):
    """-> dq, dk, dv."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], selection.shape[-1]
    block_d = triton.next_power_of_2(D)
    order, first, count = entry_lists(selection, block_size)
    delta = (do.float() * o.float()).sum(-1)  # §5 Delta = rowsum(dO * O), (B, H, T)
    constants = _constants(q, block_size)

    block_m, block_n, warps, stages = _tile("dq", q)
    work = work_items(count, T, S, block_m)
    dq_part = torch.zeros(B, H, T, S, block_d, dtype=torch.float32, device=q.device)
    _moba_bwd_dq[(work.shape[0],)](q, k, v, do, lse, delta, dq_part, work, order, first, count,
                                   *q.stride(), *k.stride(), *v.stride(), *do.stride(),
                                   H, H // Hkv, T, S, count.numel(), count.shape[1], scale,
                                   **constants, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    dq = triton_flash.empty_bthd(B, H, T, D, q)
    dq.copy_(dq_part[..., :D].sum(-2))

    dk = triton_flash.empty_bthd(B, Hkv, T, D, k)
    dv = triton_flash.empty_bthd(B, Hkv, T, D, v)
    block_m, block_n, warps, stages = _tile("dkdv", q)
    _moba_bwd_dkdv[(triton.cdiv(T, block_n), B * Hkv)](
        q, k, v, do, dk, dv, lse, delta, order, first, count,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        H, H // Hkv, T, S, count.shape[1], scale,
        **constants, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return dq, dk, dv


@torch.library.custom_op("nanoflash::moba_fwd", mutates_args=())
def moba_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: torch.Tensor, block_size: int,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(q, k, v, selection, block_size, scale)


@moba_fwd.register_fake
def _moba_fwd_fake(q, k, v, selection, block_size, scale):
    B, H, T, D = q.shape
    return triton_flash.empty_bthd(B, H, T, D, q), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("nanoflash::moba_bwd", mutates_args=())
def moba_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             lse: torch.Tensor, selection: torch.Tensor, block_size: int,
             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(do, q, k, v, o, lse, selection, block_size, scale)


@moba_bwd.register_fake
def _moba_bwd_fake(do, q, k, v, o, lse, selection, block_size, scale):
    return tuple(triton_flash.empty_bthd(*t.shape, t) for t in (q, k, v))


class MobaFunction(torch.autograd.Function):
    """Autograd for the MoBA kernels (the selection gets no gradient); under torch.compile it calls the
    custom ops, in eager mode the launchers directly (see triton_op.py for why)."""

    @staticmethod
    def forward(ctx, q, k, v, selection, block_size: int, scale: float):
        fwd = moba_fwd if torch.compiler.is_compiling() else forward
        o, lse = fwd(q, k, v, selection, block_size, scale)
        ctx.save_for_backward(q, k, v, o, lse, selection)
        ctx.block_size, ctx.scale = block_size, scale
        return o

    @staticmethod
    def backward(ctx, do):
        bwd = moba_bwd if torch.compiler.is_compiling() else backward
        dq, dk, dv = bwd(do, *ctx.saved_tensors, ctx.block_size, ctx.scale)
        return dq, dk, dv, None, None, None


def moba_triton(q, k, v, selection: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """MoBA attention of q (B, Hq, T, D), k, v (B, Hkv, T, D) over selection (B, Hq, T, topk + 1)
    (attention/moba.py:moba_select). block_size must be a multiple of the kernel's tiles (128)."""
    from .triton_op import _check_kernel_support

    _check_kernel_support(q)
    if block_size % 128 and not triton_flash.INTERPRET:
        raise ValueError(f"the triton MoBA kernel needs block_size a multiple of 128 (its tiles), got {block_size}; "
                         "the MoBA paper uses 512")
    return MobaFunction.apply(q, k, v, selection, block_size, scale)
