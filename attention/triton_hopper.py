"""The forward pass on Hopper (H100, H200), warp-specialized: FlashAttention-3's layout, in Gluon (§12).

The math is triton_flash.py's forward (§2 online softmax, §4 log-sum-exp, §6 causal alignment, §8 exp2
and fully-masked rows); what changes is which warps do what. There, every warp of a program loads,
multiplies and runs the softmax in turn. Here a program (128 query rows of one batch, head) splits:

  _load_tiles         a producer warp: Q once, then K_j, V_j by TMA into a ring of STAGES shared-memory
                      slots, each slot refilled as soon as both consumers are done with it;
  _softmax_rows       two consumer warpgroups of 64 rows each: the online softmax over the key tiles,
                      S_j = Q K_j^T issued together with P_{j-1} V_{j-1} (async wgmma) so the softmax
                      of tile j runs while the tensor cores multiply the previous tile.

`tl` cannot say any of this on Hopper (docs/perf_notes.md: Triton 3.6's automatic warp specialization
hangs there, and `tl` waits for every matmul at once). Gluon, Triton's lower-level language, makes the
layouts, shared memory, barriers and warp partitions explicit. The tuner of triton_flash.forward times
this kernel against the `tl` one on sm_90 and keeps the faster for each shape; on the H200 that is this
kernel for hs=128 at long sequences, the `tl` kernel at GPT-2's T=1024 (perf notes). Gluon has no CPU
interpreter: its tests run on the GPU (tests/test_triton_gpu.py), and CI compiles it for sm_90.

Synchronisation, per ring slot s, with mbarriers (a phase bit flips each time the expected arrivals land):
  kv_ready[s]  the copy engine arrives when K_j and V_j (2 tiles of bytes, announced with expect) are in;
  kv_empty[s]  count 2: each consumer warpgroup arrives when it has finished reading K_j and V_j.
The j-th key tile lives in slot j % STAGES, in that slot's phase (j // STAGES) & 1. No barrier spans the
whole program, so neither warpgroup waits for the other.
"""
import functools
import os

import torch
import triton
import triton.language as tl

# Gluon is experimental and its API moves between releases: this file is written for, and compiled with, Triton
# 3.6 (the GPU box) and 3.9 (CI). Older Triton has no Gluon or another API; the `tl` forward then runs everywhere.
gluon = None
if tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 6):
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# (BLOCK_N, STAGES) per head dim, fastest first on the H200 (benchmarks/results/2026-11-22-h200-ws-gluon-fwd/):
# K and V tiles of BLOCK_N rows in a ring of STAGES slots. 12 warps: two consumer warpgroups and the producer's.
TILES = {64: [(128, 3), (128, 2), (64, 4)], 128: [(64, 3), (64, 4)]}
# (constexpr: the kernels read them)
ROWS = tl.constexpr(64)  # query rows per consumer warpgroup: one wgmma is 64 rows tall
BLOCK_M = tl.constexpr(2 * 64)  # query rows per program
# registers per thread: 168 for the launch (12 warps fill the register file), then setmaxnreg moves them
# from the producer, which needs few, to the consumers, which hold S, P and O (no spills at these tiles)
LAUNCH_REGS, CONSUMER_REGS, PRODUCER_REGS = 168, tl.constexpr(240), tl.constexpr(24)


if gluon is not None:
    # Triton 3.9 renamed the TMA load; this file compiles with 3.6 (the GPU box) and 3.9 (CI)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.jit
    def _load_tiles(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, kv_ready, kv_empty, b, h, kv_h, start_m,
                    n_tiles):
        """The producer warp. Descriptors are 4-D (B, H, T, D) with a (1, 1, rows, D) block: rows past T
        arrive as zeros, whatever the strides (§9), so a ragged last tile needs no special load."""
        # Triton 3.6 hands warp_specialize's constexpr arguments to a partition as tensors: constants come from shapes
        STAGES: gl.constexpr = k_smem.shape[0]
        BLOCK_N: gl.constexpr = k_smem.shape[1]
        HEAD_DIM: gl.constexpr = k_smem.shape[2]
        mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
        for half in gl.static_range(2):
            _tma_load(q_desc, [b, h, start_m + half * ROWS, 0], q_ready,
                      q_smem.index(half).reshape([1, 1, ROWS, HEAD_DIM]))
        for j in range(n_tiles):
            slot = j % STAGES
            # wait until both consumers released the slot's previous tile; a fresh mbarrier counts as having
            # completed the phase before phase 0, so the first pass through the ring does not wait
            mbarrier.wait(kv_empty.index(slot), ((j // STAGES) & 1) ^ 1)
            ready = kv_ready.index(slot)
            mbarrier.expect(ready, 2 * k_desc.block_type.nbytes)
            _tma_load(k_desc, [b, kv_h, j * BLOCK_N, 0], ready, k_smem.index(slot).reshape([1, 1, BLOCK_N, HEAD_DIM]))
            _tma_load(v_desc, [b, kv_h, j * BLOCK_N, 0], ready, v_smem.index(slot).reshape([1, 1, BLOCK_N, HEAD_DIM]))

    @gluon.jit
    def _mask_keys(s, first_row, start_n, diag, Tk, s_layout: gl.constexpr):
        """s (ROWS, N) with -inf past each row's last visible key, min(row + diag, Tk - 1) (§6: diag = Tk - Tq
        under the causal mask; Tk otherwise, when only a ragged last tile's zero rows are hidden)."""
        BLOCK_N: gl.constexpr = s.shape[1]
        rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (ROWS,)
        last_key = gl.minimum(rows + diag, Tk - 1)
        keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # (N,)
        return gl.where(keys[None, :] <= last_key[:, None], s, float("-inf"))

    @gluon.jit
    def _softmax_rows(WG: gl.constexpr, q_smem, k_smem, v_smem, q_ready, kv_ready, kv_empty, O, stride_ot, LSE,
                      start_m, n_tiles, Tq, Tk, diag, qk_scale):
        """Consumer warpgroup WG: rows start_m + WG * 64 ... + 63, their O and log-sum-exp."""
        STAGES: gl.constexpr = k_smem.shape[0]
        BLOCK_N: gl.constexpr = k_smem.shape[1]
        HEAD_DIM: gl.constexpr = k_smem.shape[2]
        # wgmma's accumulator layouts: 4 warps stacked along the rows, instructions 16 rows by N (or D) columns
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)  # P from registers
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

        first_row = start_m + WG * ROWS
        # §6 the key tiles any of these rows sees (at least one: a row that sees no key still gets its 0 and
        # +inf from a fully masked tile), and the first key not every row sees: tiles reaching past it are masked
        n_mine = gl.maximum(gl.cdiv(gl.minimum(first_row + ROWS - 1 + diag, Tk - 1) + 1, BLOCK_N), 1)
        mask_from = gl.minimum(first_row + diag, Tk - 1) + 1
        q = q_smem.index(WG)
        mbarrier.wait(q_ready, 0)

        # tile 0 alone: S_0, its softmax; from then on each S_j goes to the tensor cores with P_{j-1} V_{j-1}
        mbarrier.wait(kv_ready.index(0), 0)
        s_token = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                                use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s_token])  # (ROWS, N)
        if BLOCK_N > mask_from:
            s = _mask_keys(s, first_row, 0, diag, Tk, s_layout)
        m_i = gl.max(s, 1) * qk_scale  # §8 base-2 scores: the max commutes with the positive scale
        p = gl.exp2(s * qk_scale - gl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        l_i = gl.sum(p, 1)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

        for j in range(1, n_mine):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(kv_ready.index(slot), (j // STAGES) & 1)
            p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
            s_token = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)),
                                    gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
            o_token = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s_token])  # S_j is ready; P_{j-1} V_{j-1} may still be running
            if (j + 1) * BLOCK_N > mask_from:
                s = _mask_keys(s, first_row, j * BLOCK_N, diag, Tk, s_layout)
            # §2 online softmax, as in triton_flash._fwd_tile
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # §8 rows that have seen no key yet
            p = gl.exp2(s * qk_scale - m_ref[:, None])
            alpha = gl.exp2(m_i - m_ref)
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = warpgroup_mma_wait(0, deps=[o_token])
            mbarrier.arrive(kv_empty.index(prev), count=1)  # done with K_{j-1}, V_{j-1}: the producer may refill
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        last = (n_mine - 1) % STAGES
        o_token = warpgroup_mma(gl.convert_layout(p.to(q_smem.dtype), p_layout), v_smem.index(last), acc,
                                is_async=True)
        acc = warpgroup_mma_wait(0, deps=[o_token])
        mbarrier.arrive(kv_empty.index(last), count=1)
        for j in range(n_mine, n_tiles):  # tiles only the other warpgroup's rows see: release them unread
            mbarrier.wait(kv_ready.index(j % STAGES), (j // STAGES) & 1)
            mbarrier.arrive(kv_empty.index(j % STAGES), count=1)

        # §4, §8: O = acc / l, lse = (m + log2 l) ln 2; a row that saw no key gets O = 0 and lse = +inf
        l_o = gl.convert_layout(l_i, o_rows)
        seen = l_o > 0
        l_safe = gl.where(seen, l_o, 1.0)
        rows = first_row + gl.arange(0, ROWS, layout=o_rows)  # (ROWS,)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))  # (D,)
        o_ptrs = O + rows.to(gl.int64)[:, None] * stride_ot + cols[None, :]
        gl.store(o_ptrs, (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=(rows < Tq)[:, None])
        lse = gl.where(seen, (gl.convert_layout(m_i, o_rows) + gl.log2(l_safe)) * 0.6931471805599453, float("inf"))
        gl.store(LSE + rows, lse, mask=rows < Tq)

    @gluon.jit
    def _softmax_rows_0(q_smem, k_smem, v_smem, q_ready, kv_ready, kv_empty, O, stride_ot, LSE, start_m, n_tiles, Tq,
                        Tk, diag, qk_scale):
        _softmax_rows(0, q_smem, k_smem, v_smem, q_ready, kv_ready, kv_empty, O, stride_ot, LSE, start_m, n_tiles, Tq,
                      Tk, diag, qk_scale)

    @gluon.jit
    def _softmax_rows_1(q_smem, k_smem, v_smem, q_ready, kv_ready, kv_empty, O, stride_ot, LSE, start_m, n_tiles, Tq,
                        Tk, diag, qk_scale):
        _softmax_rows(1, q_smem, k_smem, v_smem, q_ready, kv_ready, kv_empty, O, stride_ot, LSE, start_m, n_tiles, Tq,
                      Tk, diag, qk_scale)

    @gluon.jit
    def _attn_fwd_ws(q_desc, k_desc, v_desc, O, LSE, stride_ob, stride_oh, stride_ot, H, GROUP, Tq, Tk, diag, scale,
                     CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """A program per (128-row query tile, batch*head): sets up the shared memory and barriers, then
        splits into the producer and the two consumers."""
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        tile_m = gl.program_id(0)
        if CAUSAL:
            tile_m = gl.num_programs(0) - 1 - tile_m  # §9 work order: the longest rows first
        start_m = tile_m * BLOCK_M
        bh = gl.program_id(1)
        b, h = bh // H, bh % H
        # §6 key tiles the program's last row sees; at least one, so every consumer has a tile to wait for
        n_tiles = gl.maximum(gl.cdiv(gl.minimum(start_m + BLOCK_M - 1 + diag, Tk - 1) + 1, BLOCK_N), 1)
        O += b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh  # this (batch, head)'s (Tq, D) output
        LSE += bh.to(gl.int64) * Tq

        # K and V share a layout: the same block shape, swizzled for wgmma; 2-D views of the 4-D TMA blocks
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], q_desc.dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], k_desc.dtype)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, ROWS, HEAD_DIM], q_layout)  # a half per consumer
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # one arrival per consumer warpgroup
        fence_async_shared()  # the initialised barriers, visible to the copy engine before its first arrive

        consumer_args = (q_smem, k_smem, v_smem, q_ready, kv_ready, kv_empty, O, stride_ot, LSE, start_m, n_tiles, Tq,
                         Tk, diag, scale * 1.4426950408889634)
        gl.warp_specialize([
            (_softmax_rows_0, consumer_args),  # the default partition: the launch's 4 warps
            (_softmax_rows_1, consumer_args),
            (_load_tiles, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, kv_ready, kv_empty, b, h,
                           h // GROUP, start_m, n_tiles)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@functools.cache
def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dense: bool) -> bool:
    """Whether this kernel can run the call: Gluon present, an sm_90 GPU (wgmma is Hopper's alone), a dense
    mask, fp16/bf16, head dim 64 or 128, and tensors the copy engine reads (unit stride along the head
    dim, other strides and the start 16-byte aligned). Anything else takes the `tl` forward."""
    if gluon is None or os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter does not run Gluon
        return False
    if not dense or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in TILES:
        return False
    if not _is_hopper(q.device):
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1]) for t in (q, k, v))


def _descriptor(t: torch.Tensor, rows: int) -> "TensorDescriptor":
    """A (B, H, T, D) tensor, any strides, read in (1, 1, rows, D) blocks."""
    block = [1, 1, rows, t.shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float16 if t.dtype == torch.float16 else gl.bfloat16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def forward(q, k, v, o, lse, causal: bool, scale: float, tile: tuple[int, int]):
    """Write O into o (B, Hq, Tq, D), any strides with a unit last one, and lse (B, Hq, Tq) float32, natural
    log. q (B, Hq, Tq, D), k, v (B, Hkv, Tk, D) as `supports` allows. tile: (BLOCK_N, STAGES) from TILES.
    -> the compiled kernel (the tuner logs its registers)."""
    B, Hq, Tq, _ = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    block_n, stages = tile
    diag = Tk - Tq if causal else Tk  # §6: row i sees keys <= i + diag (and < Tk)
    return _attn_fwd_ws[(triton.cdiv(Tq, BLOCK_M.value), B * Hq)](
        _descriptor(q, ROWS.value), _descriptor(k, block_n), _descriptor(v, block_n), o, lse,
        o.stride(0), o.stride(1), o.stride(2), Hq, Hq // Hkv, Tq, Tk, diag, scale,
        CAUSAL=causal, BLOCK_N=block_n, STAGES=stages, num_warps=4, maxnreg=LAUNCH_REGS)
