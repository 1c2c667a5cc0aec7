"""MoBA (attention/moba/reference.py) in Triton's `tl`: each query attends only to the key blocks it selected (§11 of
docs/flash_attention.md). These kernels run on every GPU and in the CPU interpreter; on an sm_90 GPU
moba/op.py runs moba/hopper.py instead, which shares the router and the merge.

Queries next to each other select different blocks, so a tile of consecutive queries would have to
visit the union of their selections, which for a long sequence is nearly every block. Instead the
work is organised by key block: for each block, the list of queries that selected it is gathered
(an "entry" is one (query, slot) pair of the selection), and a program attends one tile of gathered
queries to that block. A query's topk + 1 blocks are handled by different programs, each leaving a
partial result (output and log-sum-exp, §4) in the query's slot; a merge by log-sum-exp combines
them, the same rescaling as the online softmax (§2), done once across slots instead of per tile.

Kernels (reusing the dense kernels' tile functions from flash/tl_forward.py):
  _moba_gate       the router: block scores and top-k for a tile of queries (moba_select, fused)
  _moba_fwd        a program per (key block, tile of its entries): partial out + lse per entry
  _moba_merge      a query's slots combined by log-sum-exp (dQ: summed), through a table of rows
  _row_delta       Delta = rowsum(dO * O) per query, before the backward kernels (§5)
  _moba_bwd_dq     the same programs: dQ per entry, summed over a query's slots afterwards
  _moba_bwd_dkdv   a program per (key tile, batch*kv_head): dK, dV from every entry of its block,
                   over the GQA group (§7), no atomics
Each query always selects its own block, under the causal mask: within a block's list those entries
come first, in query order (entries are sorted by query), so the dense kernels' causal tile skipping
(§6) applies to them: an own-query tile stops at its last query's key, a key tile skips the own
queries before it, and only the tiles on the diagonal and the last, ragged one are masked; the rest
see the whole block.
"""
import functools

import torch
import triton
import triton.language as tl

from ..flash.dispatch import empty_bthd
from ..flash.tl_backward import dkdv_tile, dq_tile
from ..flash.tl_forward import fwd_tile
from ..flash.tl_tiles import LN2, LOG2E, head_base, key_ranges, load_rows, store_rows
from ..flash.tuner import tuned_launch


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
    # empty slots sort into an extra block at the end. A stable sort keeps each block's entries in
    # ascending entry (so query) order, and sorting the small block ids, not entry-unique int64 keys,
    # needs a quarter of the radix sort's passes
    block = torch.where(chosen >= 0, chosen, n_blocks).to(torch.int16 if n_blocks < 2**15 else torch.int32)
    sorted_block, order = torch.sort(block, dim=-1, stable=True)
    # where each block's run starts in the sorted row; a run ends where the next block's starts
    starts = torch.searchsorted(sorted_block, torch.arange(n_blocks + 1, dtype=block.dtype, device=block.device)
                                .expand(B * H, -1).contiguous())
    first, count = starts[:, :-1], starts[:, 1:] - starts[:, :-1]
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
    """The work item of this program -> (batch*head, key block, tile of the block's list, its gathered
    entries (M,), their query positions (M,) (T for padding rows, so row-checked loads read 0), which
    rows are real, and whether the tile holds queries of the block itself (own: under the causal mask;
    they come first in a list, in query order)."""
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
    return bh, block, tile, entry, q_pos, valid, tile * BLOCK_M < own_queries


@triton.jit
def _block_key_ranges(block, tile, own, T, MOBA_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys a tile of a block's list visits, as the dense kernels' ranges (§6 tile skipping):
    [start, full_end) unmasked, [full_end, end) masked. A tile of the block's own queries (own) holds
    queries first, first + 1, ... (row r of the list is query start + r): keys up to first are visible
    to all of its rows, keys after its last query to none, so its walk stops there. Later queries see
    the whole block (a past block is never cut off by T)."""
    start = block * MOBA_BLOCK
    full_end = tl.minimum(start + MOBA_BLOCK, T)
    end = full_end
    if own:
        _, _, full_end, end = key_ranges(start + tile * BLOCK_M, T, T, 0, 0, BLOCK_M, BLOCK_N, True, False)
    return start, full_end, end


@triton.jit
def _moba_fwd(Q, K, V, O_PART, LSE_PART, WORK, ORDER, FIRST, COUNT,
              stride_qb, stride_qh, stride_qt, stride_qd,
              stride_kb, stride_kh, stride_kt, stride_kd,
              stride_vb, stride_vh, stride_vt, stride_vd,
              H, GROUP, T, S, n_lists, n_blocks, scale,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MOBA_BLOCK: tl.constexpr,
              DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh, block, tile, entry, q_pos, valid, own = _entry_tile(WORK, ORDER, FIRST, COUNT, n_lists, n_blocks, T, S,
                                                        MOBA_BLOCK, BLOCK_M)
    b, h = bh // H, bh % H
    K = head_base(K, b, h // GROUP, stride_kb, stride_kh)  # §7
    V = head_base(V, b, h // GROUP, stride_vb, stride_vh)
    cols = tl.arange(0, BLOCK_D)  # (D,)
    q = load_rows(head_base(Q, b, h, stride_qb, stride_qh), q_pos, T, stride_qt, cols, stride_qd,
                   HEAD_DIM, True)  # (M, D): gathered rows
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E

    start, full_end, end = _block_key_ranges(block, tile, own, T, MOBA_BLOCK, BLOCK_M, BLOCK_N)
    for start_n in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = fwd_tile(acc, m_i, l_i, q, K, V, start_n, start_n + tl.arange(0, BLOCK_N), stride_kt,
                                  stride_kd, stride_vt, stride_vd, cols, T, qk_scale, None, HEAD_DIM, DOT_PRECISION)
    for start_n in range(full_end, end, BLOCK_N):  # own queries' diagonal (and the last block's ragged end)
        k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < T)
        acc, m_i, l_i = fwd_tile(acc, m_i, l_i, q, K, V, start_n, k_pos, stride_kt, stride_kd, stride_vt,
                                  stride_vd, cols, T, qk_scale, visible, HEAD_DIM, DOT_PRECISION)

    # every entry sees at least one key (its own query's block holds the query itself), so l > 0
    out_rows = bh.to(tl.int64) * T * S + entry  # (M,) the entries' slots
    tl.store(O_PART + out_rows[:, None] * BLOCK_D + cols[None, :], acc / l_i[:, None], mask=valid[:, None])
    tl.store(LSE_PART + out_rows, (m_i + tl.log2(l_i)) * LN2, mask=valid)


@triton.jit
def _moba_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ_PART, Q_LISTED, DO_LISTED, LSE_LISTED, DELTA_LISTED,
                 WORK, ORDER, FIRST, COUNT,
                 stride_qb, stride_qh, stride_qt, stride_qd,
                 stride_kb, stride_kh, stride_kt, stride_kd,
                 stride_vb, stride_vh, stride_vt, stride_vd,
                 stride_dob, stride_doh, stride_dot, stride_dod,
                 H, GROUP, T, S, n_lists, n_blocks, scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MOBA_BLOCK: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh, block, tile, entry, q_pos, valid, own = _entry_tile(WORK, ORDER, FIRST, COUNT, n_lists, n_blocks, T, S,
                                                        MOBA_BLOCK, BLOCK_M)
    b, h = bh // H, bh % H
    K = head_base(K, b, h // GROUP, stride_kb, stride_kh)
    V = head_base(V, b, h // GROUP, stride_vb, stride_vh)
    cols = tl.arange(0, BLOCK_D)
    q = load_rows(head_base(Q, b, h, stride_qb, stride_qh), q_pos, T, stride_qt, cols, stride_qd, HEAD_DIM, True)
    do = load_rows(head_base(DO, b, h, stride_dob, stride_doh), q_pos, T, stride_dot, cols, stride_dod,
                    HEAD_DIM, True)  # (M, D)
    # the merged (final) log-sum-exp and Delta of each query: P over this block is exp(s - lse) of the
    # whole row, so the partial dQ of each slot adds up to the row's dQ (§5)
    lse = tl.load(LSE + bh.to(tl.int64) * T + q_pos, mask=valid, other=float("inf"))  # (M,)
    delta = tl.load(DELTA + bh.to(tl.int64) * T + q_pos, mask=valid, other=0.0)  # (M,)
    # The dK/dV kernel walks each block's entries in list order. Gathering rows by index inside its
    # loop stalls it (the row index must arrive before the row can be fetched, and Triton's software
    # pipelining does not hide that), so this kernel, which has the gathered rows in registers anyway,
    # writes them out in list order: there they are contiguous rows, streamed like the dense kernel's.
    listed = bh.to(tl.int64) * T * S + tl.load(FIRST + bh * n_blocks + block) + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(Q_LISTED + listed[:, None] * HEAD_DIM + cols[None, :], q, mask=valid[:, None] & (cols[None, :] < HEAD_DIM))
    tl.store(DO_LISTED + listed[:, None] * HEAD_DIM + cols[None, :], do, mask=valid[:, None] & (cols[None, :] < HEAD_DIM))
    tl.store(LSE_LISTED + listed, lse, mask=valid)
    tl.store(DELTA_LISTED + listed, delta, mask=valid)
    lse2 = lse * LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E
    # dq_tile also sums each row's P * dP for a call with sinks (flash/tl_backward.py, §15); MoBA has none, so the
    # sums start at zero, go unused and compile out
    pdp = tl.zeros([BLOCK_M], tl.float32)

    start, full_end, end = _block_key_ranges(block, tile, own, T, MOBA_BLOCK, BLOCK_M, BLOCK_N)  # as the forward
    for start_n in range(start, full_end, BLOCK_N):
        dq, _ = dq_tile(dq, q, do, lse2, delta, K, V, start_n + tl.arange(0, BLOCK_N), stride_kt, stride_kd,
                         stride_vt, stride_vd, cols, T, qk_scale, None, HEAD_DIM, DOT_PRECISION, pdp=pdp)
    for start_n in range(full_end, end, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < T)
        dq, _ = dq_tile(dq, q, do, lse2, delta, K, V, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols,
                         T, qk_scale, visible, HEAD_DIM, DOT_PRECISION, pdp=pdp)
    out_rows = bh.to(tl.int64) * T * S + entry
    tl.store(DQ_PART + out_rows[:, None] * BLOCK_D + cols[None, :], dq * scale, mask=valid[:, None])


@triton.jit
def _moba_bwd_dkdv(Q_LISTED, K, V, DO_LISTED, DK, DV, LSE_LISTED, DELTA_LISTED, ORDER, FIRST, COUNT,
                   stride_kb, stride_kh, stride_kt, stride_kd,
                   stride_vb, stride_vh, stride_vt, stride_vd,
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
    k = load_rows(head_base(K, b, h_kv, stride_kb, stride_kh), k_pos, T, stride_kt, cols, stride_kd, HEAD_DIM, True)
    v = load_rows(head_base(V, b, h_kv, stride_vb, stride_vh), k_pos, T, stride_vt, cols, stride_vd, HEAD_DIM, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E
    own_queries = tl.minimum(MOBA_BLOCK, T - block * MOBA_BLOCK)
    first = start_n - block * MOBA_BLOCK  # the key tile's offset in its block

    for g in range(GROUP):  # §7 GQA gradient sum, as in the dense dK/dV kernel
        bh = b * H + h_kv * GROUP + g
        item = bh * n_blocks + block
        listed = bh.to(tl.int64) * T * S + tl.load(FIRST + item)  # this block's list in the listed copies
        count = tl.load(COUNT + item)
        Q = Q_LISTED + listed * HEAD_DIM  # (count, HEAD_DIM) rows, written by _moba_bwd_dq
        DO = DO_LISTED + listed * HEAD_DIM
        LSE = LSE_LISTED + listed
        DELTA = DELTA_LISTED + listed
        # Rows of the list: [0, own_end) are the block's own queries, row r query block_start + r, which sees
        # this key tile from r = first on and all of it from r = first + BLOCK_N - 1 (§6 as in the dense
        # kernel): the row tiles before the one holding row first are skipped, those up to diag_end masked;
        # [diag_end, full_end) see the whole key tile; [full_end, count) is the ragged last tile
        own_end = tl.minimum(tl.cdiv(own_queries, BLOCK_M) * BLOCK_M, count)
        diag_end = tl.minimum(tl.cdiv(first + BLOCK_N - 1, BLOCK_M) * BLOCK_M, own_end)
        full_end = tl.maximum(count // BLOCK_M * BLOCK_M, diag_end)
        for rows in range(first // BLOCK_M * BLOCK_M, diag_end, BLOCK_M):
            dk, dv = _moba_dkdv_masked(dk, dv, k, v, k_pos, Q, DO, LSE, DELTA, ORDER + listed, rows, count, T, S,
                                       cols, qk_scale, HEAD_DIM, DOT_PRECISION, BLOCK_M)
        for rows in range(diag_end, full_end, BLOCK_M):
            dk, dv = dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, rows + tl.arange(0, BLOCK_M), HEAD_DIM, 1, HEAD_DIM, 1,
                                cols, count, qk_scale, None, HEAD_DIM, DOT_PRECISION)
        for rows in range(full_end, count, BLOCK_M):
            dk, dv = _moba_dkdv_masked(dk, dv, k, v, k_pos, Q, DO, LSE, DELTA, ORDER + listed, rows, count, T, S,
                                       cols, qk_scale, HEAD_DIM, DOT_PRECISION, BLOCK_M)

    DK = head_base(DK, b, h_kv, stride_dkb, stride_dkh)
    DV = head_base(DV, b, h_kv, stride_dvb, stride_dvh)
    store_rows(DK, dk * scale, k_pos, T, stride_dkt, cols, stride_dkd, HEAD_DIM)
    store_rows(DV, dv, k_pos, T, stride_dvt, cols, stride_dvd, HEAD_DIM)


@triton.jit
def _moba_dkdv_masked(dk, dv, k, v, k_pos, Q, DO, LSE, DELTA, ENTRIES, rows, count, T, S, cols, qk_scale,
                      HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    """One tile of a block's listed entries that needs the mask: causal (by the entries' query
    positions), and padding rows past the end of the list."""
    listed = rows + tl.arange(0, BLOCK_M)  # (M,) rows of the listed copies
    valid = listed < count
    q_pos = tl.load(ENTRIES + listed, mask=valid, other=0) // S  # (M,) the entries' queries
    visibleT = (k_pos[:, None] <= q_pos[None, :]) & (k_pos[:, None] < T) & valid[None, :]  # (N, M)
    return dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, listed, HEAD_DIM, 1, HEAD_DIM, 1, cols, count, qk_scale,
                      visibleT, HEAD_DIM, DOT_PRECISION)


@triton.jit
def _moba_merge(PART, LSE_PART, POS, OUT, LSE, stride_part, stride_ob, stride_oh, stride_ot, stride_od, H, T,
                S: tl.constexpr, WEIGHTED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_T: tl.constexpr):
    """§11 merge of each query's slots into OUT (B, H, T, D): slot s of query t is row POS[b, h, t, s] of PART
    (rows of BLOCK_D values, stride_part apart) and LSE_PART; empty slots (POS -1), whose rows were never written,
    are skipped. WEIGHTED (forward): the log-sum-exp merge of partial outputs, also storing the row's lse; otherwise
    (dQ) a plain sum."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (T_tile,)
    cols = tl.arange(0, BLOCK_D)
    slots = bh.to(tl.int64) * T * S + t * S  # (T_tile,) each query's first slot
    lse = tl.zeros([BLOCK_T], tl.float32)
    if WEIGHTED:  # lse = log sum_s exp(lse_s), computed stably around the largest
        m = tl.full([BLOCK_T], float("-inf"), tl.float32)
        for s in tl.static_range(S):
            row = tl.load(POS + slots + s, mask=t < T, other=-1)
            m = tl.maximum(m, tl.load(LSE_PART + row, mask=row >= 0, other=float("-inf")))
        total = tl.zeros([BLOCK_T], tl.float32)
        for s in tl.static_range(S):
            row = tl.load(POS + slots + s, mask=t < T, other=-1)
            total += tl.exp(tl.load(LSE_PART + row, mask=row >= 0, other=float("-inf")) - m)
        lse = m + tl.log(total)
        tl.store(LSE + bh.to(tl.int64) * T + t, lse, mask=t < T)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for s in tl.static_range(S):
        row = tl.load(POS + slots + s, mask=t < T, other=-1)
        part = tl.load(PART + row.to(tl.int64)[:, None] * stride_part + cols[None, :], mask=(row >= 0)[:, None],
                       other=0.0).to(tl.float32)  # an empty slot's row: zeros
        if WEIGHTED:
            part *= tl.exp(tl.load(LSE_PART + row, mask=row >= 0, other=float("-inf")) - lse)[:, None]
        acc += part
    store_rows(head_base(OUT, b, h, stride_ob, stride_oh), acc, t, T, stride_ot, cols, stride_od, HEAD_DIM)


@triton.jit
def _row_delta(O, DO, DELTA, stride_ob, stride_oh, stride_ot, stride_od, stride_dob, stride_doh, stride_dot, stride_dod,
               H, T, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """§5 Delta = rowsum(dO * O) in fp32 for BLOCK_T rows of one head: one pass over O and dO before the
    MoBA backward (the dense dQ kernel computes it on the side, but a query's MoBA rows are spread over
    several programs). In PyTorch the same sum converts both to fp32 in memory first: 3x the traffic."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (T_tile,)
    cols = tl.arange(0, BLOCK_D)
    o = load_rows(head_base(O, b, h, stride_ob, stride_oh), t, T, stride_ot, cols, stride_od, HEAD_DIM, True)
    do = load_rows(head_base(DO, b, h, stride_dob, stride_doh), t, T, stride_dot, cols, stride_dod, HEAD_DIM, True)
    tl.store(DELTA + bh.to(tl.int64) * T + t, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=t < T)


@triton.jit
def _moba_gate(Q, MEANS, SELECTION, stride_qb, stride_qh, stride_qt, stride_qd, H, GROUP, T, n_blocks,
               TOPK: tl.constexpr, MOBA_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr):
    """MoBA's router for a tile of queries, fused: scores q . mean(k) against every block (one tl.dot,
    fp32-accurate), past blocks only, then the top-k by repeated argmax, written as moba_select's
    (T, TOPK + 1) rows [own block, best, second, ..., -1 where a query has too few past blocks]."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    q_pos = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (M,)
    cols = tl.arange(0, BLOCK_D)
    q = load_rows(head_base(Q, b, h, stride_qb, stride_qh), q_pos, T, stride_qt, cols, stride_qd, HEAD_DIM, True)
    blocks = tl.arange(0, BLOCK_B)  # (NB,)
    means = tl.load(MEANS + ((b * (H // GROUP) + h // GROUP) * n_blocks + blocks)[:, None] * HEAD_DIM + cols[None, :],
                    mask=(blocks[:, None] < n_blocks) & (cols[None, :] < HEAD_DIM), other=0.0)  # (NB, D) float32
    # fp32-accurate scores on tensor cores ("ieee" fp32 runs far slower here): tf32x3, three TF32 products that split
    # both sides into a TF32 part and the rest; a 16-bit q is a TF32 number already, so only the means are split and
    # two products give the same sum
    if q.dtype == tl.float32:
        scores = tl.dot(q, tl.trans(means), input_precision="tf32x3")  # (M, NB)
    else:
        means_tf32 = (means.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)  # 10-bit mantissa
        q = q.to(tl.float32)
        scores = (tl.dot(q, tl.trans(means_tf32), input_precision="tf32")
                  + tl.dot(q, tl.trans(means - means_tf32), input_precision="tf32"))
    own = q_pos // MOBA_BLOCK  # (M,)
    scores = tl.where(blocks[None, :] < own[:, None], scores, float("-inf"))  # past blocks only
    out = SELECTION + (bh.to(tl.int64) * T + q_pos) * (TOPK + 1)  # (M,) each query's row
    tl.store(out, own, mask=q_pos < T)
    for i in tl.static_range(TOPK):
        best = tl.argmax(scores, 1)  # (M,)
        found = tl.max(scores, 1) > float("-inf")
        tl.store(out + 1 + i, tl.where(found, best, -1), mask=q_pos < T)
        scores = tl.where(blocks[None, :] == best[:, None], float("-inf"), scores)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------
def _constants(q: torch.Tensor, block_size: int) -> dict:
    return {"HEAD_DIM": q.shape[-1], "BLOCK_D": triton.next_power_of_2(q.shape[-1]), "MOBA_BLOCK": block_size,
            "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32"}


GATE_ROWS = 64  # queries per gate program
GATE_MAX_BLOCKS = 256  # a row of scores per query stays in registers up to this many blocks


@torch.no_grad()
def moba_gate(q: torch.Tensor, means: torch.Tensor, block_size: int, topk: int) -> torch.Tensor:
    """moba_select (attention/moba/reference.py) with the scoring and top-k fused in one kernel (_moba_gate): the same
    selection from the blocks' mean keys, means (B, Hkv, n_blocks, D), without the (B, Hq, T, n_blocks) score tensor
    in memory. For at most GATE_MAX_BLOCKS blocks."""
    B, H, T, D = q.shape
    n_blocks = means.shape[2]
    selection = torch.empty(B, H, T, topk + 1, dtype=torch.int64, device=q.device)
    _moba_gate[(triton.cdiv(T, GATE_ROWS), B * H)](
        q, means.float().contiguous(), selection, *q.stride(), H, H // means.shape[1], T, n_blocks, TOPK=topk,
        MOBA_BLOCK=block_size, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_B=max(16, triton.next_power_of_2(n_blocks)), BLOCK_M=GATE_ROWS)
    return selection


MERGE_ROWS = 32  # queries per merge program (_moba_merge): S partial rows of D floats each
DELTA_ROWS = 64  # queries per _row_delta program


def merge_slots(part, lse_part, pos, out, lse) -> None:
    """Each query's slots into out (B, H, T, D) (_moba_merge): with lse (B, H, T) the log-sum-exp merge of the
    partial outputs part (rows, BLOCK_D) and their lse_part (rows,), else the sum of the rows of part.
    pos (B, H, T, S) int32: the row of each slot, -1 for an empty one."""
    B, H, T, _ = out.shape
    _moba_merge[(triton.cdiv(T, MERGE_ROWS), B * H)](
        part, lse_part, pos, out, lse, part.stride(-2), *out.stride(), H, T, S=pos.shape[-1],
        WEIGHTED=lse is not None, HEAD_DIM=out.shape[-1], BLOCK_D=part.shape[-1], BLOCK_T=MERGE_ROWS)


def slot_rows(selection: torch.Tensor) -> torch.Tensor:
    """pos for merge_slots over the `tl` kernels' partials, one row per (query, slot) in selection's order."""
    rows = torch.arange(selection.numel(), dtype=torch.int32, device=selection.device).view(selection.shape)
    return torch.where(selection >= 0, rows, -1)


def row_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """§5 Delta = rowsum(dO * O) (B, H, T) float32 (_row_delta)."""
    B, H, T, D = o.shape
    delta = torch.empty(B, H, T, dtype=torch.float32, device=o.device)
    _row_delta[(triton.cdiv(T, DELTA_ROWS), B * H)](o, do, delta, *o.stride(), *do.stride(), H, T, HEAD_DIM=D,
                                                    BLOCK_D=triton.next_power_of_2(D), BLOCK_T=DELTA_ROWS)
    return delta


def forward(q, k, v, selection, block_size: int, scale: float):
    """-> out (B, H, T, D), lse (B, H, T) float32 of the merged slots, and the entry lists
    (order, first, count) for the backward pass."""
    B, H, T, D = q.shape
    S = selection.shape[-1]
    order, first, count = entry_lists(selection, block_size)
    # one partial result per (query, slot); the merge skips the empty slots, so nothing is zero-filled
    o_part = q.new_empty(B * H * T * S, triton.next_power_of_2(D), dtype=torch.float32)
    lse_part = q.new_empty(B, H, T, S, dtype=torch.float32)
    work = functools.cache(lambda block_m: work_items(count, T, S, block_m))  # the tile decides the work list

    def args(block_m):
        return (q, k, v, o_part, lse_part, work(block_m), order, first, count, *q.stride(), *k.stride(), *v.stride(),
                H, H // k.shape[1], T, S, count.numel(), count.shape[1], scale)

    tuned_launch("fwd", _moba_fwd, lambda block_m, _: (work(block_m).shape[0],), args, _constants(q, block_size),
            T, T, q.dtype, block_size)
    o = empty_bthd(B, H, T, D, q)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    merge_slots(o_part, lse_part, slot_rows(selection), o, lse)
    return o, lse, order, first, count


def backward(do, q, k, v, o, lse, selection, order, first, count, block_size: int, scale: float):
    """-> dq, dk, dv."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], selection.shape[-1]
    delta = row_delta(o, do)
    constants = _constants(q, block_size)

    dq_part = q.new_empty(B * H * T * S, triton.next_power_of_2(D), dtype=torch.float32)
    # the entries' rows in list order, for the dK/dV kernel (see _moba_bwd_dq)
    q_listed, do_listed = (t.new_empty(B * H, T * S, D) for t in (q, do))
    lse_listed, delta_listed = (torch.empty(B * H, T * S, dtype=torch.float32, device=q.device) for _ in range(2))
    work = functools.cache(lambda block_m: work_items(count, T, S, block_m))

    def args(block_m):
        return (q, k, v, do, lse, delta, dq_part, q_listed, do_listed, lse_listed, delta_listed, work(block_m), order,
                first, count, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
                H, H // Hkv, T, S, count.numel(), count.shape[1], scale)

    tuned_launch("dq", _moba_bwd_dq, lambda block_m, _: (work(block_m).shape[0],), args, constants, T, T, q.dtype,
            block_size)
    dq = empty_bthd(B, H, T, D, q)
    merge_slots(dq_part, None, slot_rows(selection), dq, None)

    dk = empty_bthd(B, Hkv, T, D, k)
    dv = empty_bthd(B, Hkv, T, D, v)
    tuned_launch("dkdv", _moba_bwd_dkdv, lambda _, block_n: (triton.cdiv(T, block_n), B * Hkv),
            (q_listed, k, v, do_listed, dk, dv, lse_listed, delta_listed, order, first, count,
             *k.stride(), *v.stride(), *dk.stride(), *dv.stride(), H, H // Hkv, T, S, count.shape[1], scale),
            constants, T, T, q.dtype, block_size)
    return dq, dk, dv
