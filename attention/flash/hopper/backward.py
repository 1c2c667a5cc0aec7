"""The backward pass on Hopper (H100, H200), host side (§13): the `tl` pre-pass and post-pass around the
warp-specialized kernel (gluon_backward.py: the algorithm, its warps and barriers), and the launches.

    launched = backward(do, q, k, v, o, lse, dq, dk, dv, causal, scale, tile)   # three launches; launched.again repeats

A small grid of grouped heads takes a fourth: the split programs' partial dK and dV summed (§13).

The float32 dQ adds land in an order that differs from run to run, so dQ's last bits do too: this backward is not
bit-deterministic (dK and dV are). dispatch.backward takes the `tl` kernels where
torch.use_deterministic_algorithms(True) asks for determinism.
"""
import torch
import triton
import triton.language as tl

from ..device import HAS_GLUON, sm_count
from ..launch import Launched, launch, planned
from ..tl_tiles import LOG2E
from .forward import alibi_causal, forward_supports, key_problem, term_values, tma_can_read, with_term_values
from .shapes import (BACKWARD_LAUNCH_REGS, BACKWARD_TILES, DQ_GROUP_BYTES, KEY_BLOCK, KEYS, QUERY_BLOCK,
                     SPLIT_PROGRAMS_PER_SM, HopperBackwardTile)

if HAS_GLUON:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # the lse and Delta rows

    from .gluon_backward import ROW_LAYOUT, attn_bwd_ws
    from .gluon_common import descriptor, document_args, shared_layout
    from .gluon_dq import dq_cols


# --- the pre-pass and post-pass, in `tl` (they run in the CPU interpreter too) -------------------------------------
@triton.jit
def attn_bwd_prepare(O, DO, LSE, LSE_ROW, DELTA, DQ_ACC, SINK_ROWS, SINK_LOGITS, stride_ob, stride_oh, stride_ot,
                      stride_dob, stride_doh, stride_dot, H, Tq, Tq_pad, lse_unit, SLOPES, stride_slopes_b,
                      stride_slopes_h, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """Per query row, into (B*H, Tq_pad) buffers, padded to whole tiles for the kernel's TMA loads (or not, Tq_pad ==
    Tq, for a gathered problem's copies): Delta = rowsum(dO * O) (§5) and lse * lse_unit, the lse in the units the
    kernel subtracts it in (row_values_first), with 0 and +inf in the padding rows (so P = 0 there and the kernel needs
    no row mask); and the row's float32 dQ accumulator (B*H, Tq_pad, D) zeroed for the kernel's adds, unless the
    caller gives the buffer (DQ_ACC None). With sinks (SINK_LOGITS (H,)), their (B*H, Tq) rows start at
    Delta (1 - P_sink), P_sink = exp(sink - lse), to which the kernel adds the row's sum of dS = P (dP - Delta): the
    row's sum of P dP (§15, terms.sink_grad), with this Delta's rounding cancelled (the sum of P is 1 - P_sink).
    §15 SLOPES (with its strides; None without): ALiBi folded under the causal mask (the main kernel's ALIBI_CAUSAL),
    whose scores take the bias's key part alone, past the first row of their query tile of ROWS (= QUERY_BLOCK) rows:
    each row's part, slope * (row - the tile's first), joins its lse here."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (R,)
    cols = tl.arange(0, HEAD_DIM)  # (D,)
    real = rows < Tq
    o = tl.load(O + b.to(tl.int64) * stride_ob + h * stride_oh + rows[:, None] * stride_ot + cols[None, :],
                mask=real[:, None], other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h * stride_doh + rows[:, None] * stride_dot + cols[None, :],
                 mask=real[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(LSE + bh.to(tl.int64) * Tq + rows, mask=real, other=float("inf"))
    if SINK_ROWS is not None:
        p_sink = tl.exp(tl.load(SINK_LOGITS + h).to(tl.float32) - lse)  # the row's own lse, before the fold's part
        tl.store(SINK_ROWS + bh.to(tl.int64) * Tq + rows, delta * (1.0 - p_sink), mask=real)
    if SLOPES is not None:  # §15 the fold's row part (+inf stays +inf)
        slope = tl.load(SLOPES + b * stride_slopes_b + h * stride_slopes_h).to(tl.float32)
        lse += slope * tl.arange(0, ROWS).to(tl.float32)
    row_index = bh.to(tl.int64) * Tq_pad + rows  # (R,)
    padded = rows < Tq_pad
    tl.store(DELTA + row_index, delta, mask=padded)
    tl.store(LSE_ROW + row_index, lse * lse_unit, mask=padded)
    if DQ_ACC is not None:
        tl.store(DQ_ACC + row_index[:, None] * HEAD_DIM + cols[None, :], tl.zeros([ROWS, HEAD_DIM], tl.float32),
                 mask=padded[:, None])


@triton.jit
def attn_bwd_finish_dq(DQ_ACC, DQ, stride_dqb, stride_dqh, stride_dqt, H, Tq, Tq_pad, scale,
                        HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """dq = scale * the accumulated dS K (dS was taken w.r.t. the scaled scores), in dq's dtype and strides."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (R,)
    cols = tl.arange(0, HEAD_DIM)  # (D,)
    acc = tl.load(DQ_ACC + (bh.to(tl.int64) * Tq_pad + rows)[:, None] * HEAD_DIM + cols[None, :],
                  mask=(rows < Tq)[:, None])
    tl.store(DQ + b.to(tl.int64) * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqt + cols[None, :],
             (acc * scale).to(DQ.dtype.element_ty), mask=(rows < Tq)[:, None])


@triton.jit
def attn_bwd_sum_key_parts(DK_PART, DV_PART, DK, DV, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                           stride_dvt, H_kv, Tk, SPLIT, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """dK and dV of kv head h: the sums, in float32, of its SPLIT partial gradients, heads h * SPLIT ... of the
    contiguous (B, H_kv * SPLIT, Tk, D) parts (§13 "A small grid of grouped heads"), in dk's and dv's dtype and
    strides."""
    bh = tl.program_id(1)
    b, h = bh // H_kv, bh % H_kv
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (R,)
    cols = tl.arange(0, HEAD_DIM)  # (D,)
    real = (rows < Tk)[:, None]
    first = (bh.to(tl.int64) * SPLIT * Tk + rows)[:, None] * HEAD_DIM + cols[None, :]  # (R, D) in the first part
    dk = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    dv = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for j in range(SPLIT):
        dk += tl.load(DK_PART + first + j * Tk * HEAD_DIM, mask=real).to(tl.float32)
        dv += tl.load(DV_PART + first + j * Tk * HEAD_DIM, mask=real).to(tl.float32)
    tl.store(DK + b.to(tl.int64) * stride_dkb + h * stride_dkh + rows[:, None] * stride_dkt + cols[None, :],
             dk.to(DK.dtype.element_ty), mask=real)
    tl.store(DV + b.to(tl.int64) * stride_dvb + h * stride_dvh + rows[:, None] * stride_dvt + cols[None, :],
             dv.to(DV.dtype.element_ty), mask=real)


def backward_supports(q, k, v, o, do, grads, dense: bool) -> bool:
    """Whether this kernel can run the call: the Hopper forward's rules (forward_supports) for q, k, v and dO, a head
    dim in BACKWARD_TILES, and unit column strides for o and the gradients (read and written by pointers)."""
    return (q.shape[-1] in BACKWARD_TILES and forward_supports(q, k, v, dense) and tma_can_read(do)
            and all(t.stride(-1) == 1 for t in (o, *grads)))


def backward_tiles(head_dim: int, dk: torch.Tensor, dv: torch.Tensor) -> list[HopperBackwardTile]:
    """The tiles that can write these gradients: BACKWARD_TILES[head_dim], less the staged ones where the copy engine
    cannot write dk or dv (tma_can_read's rule; the gradients dispatch.backward allocates with empty_bthd always pass
    it)."""
    return [tile for tile in BACKWARD_TILES[head_dim] if not tile.dkdv_staged or tma_can_read(dk, dv)]


def row_values_first(head_dim: int) -> bool:
    """Whether the consumers' S^T and dP^T wgmmas start from -lse / scale and -Delta instead of zero (_key_gradients'
    ROWS_FIRST, §13 "The row values in the accumulators"): at hs=128, where those (M,) values, held in registers over
    the exp2s and dS, make the build spill, and starting from them leaves it none; not at hs=64, which does not spill
    and where subtracting them from the results is faster (docs/perf_notes.md, 'the row values in the backward's
    accumulators')."""
    return head_dim == 128


def key_head_split(programs: int, group: int, sms: int) -> int:
    """How many programs share each key tile of a kv head, each taking group / split of its query heads (§13 "A small
    grid of grouped heads"): 1 where the grid of one program per key tile already gives every SM
    SPLIT_PROGRAMS_PER_SM, else the smallest divisor of the group that does, at most the whole group."""
    return next((split for split in range(1, group + 1)
                 if group % split == 0 and programs * split >= SPLIT_PROGRAMS_PER_SM * sms), group)


def sum_key_parts(dk_part, dv_part, dk, dv, split: int) -> tuple[Launched, tuple]:
    """dk, dv (B, Hkv, Tk, D), any strides, = the sums of their split partial gradients (attn_bwd_sum_key_parts).
    -> its Launched and arguments."""
    B, Hkv, Tk, D = dk.shape
    args = (dk_part, dv_part, dk, dv, *dk.stride()[:3], *dv.stride()[:3], Hkv, Tk, split)
    return launch(attn_bwd_sum_key_parts, (triton.cdiv(Tk, KEYS.value), B * Hkv), args, HEAD_DIM=D,
                  ROWS=KEYS.value), args


def finish_dq(dq_acc: torch.Tensor, dq: torch.Tensor, Tq_pad: int, scale: float) -> tuple[Launched, tuple]:
    """dq (B, H, Tq, D), any strides, = scale * the float32 dS K in dq_acc (B*H*Tq_pad, D) (attn_bwd_finish_dq).
    -> its Launched and arguments."""
    B, H, Tq, D = dq.shape
    args = (dq_acc, dq, *dq.stride()[:3], H, Tq, Tq_pad, scale)
    return launch(attn_bwd_finish_dq, (triton.cdiv(Tq, QUERY_BLOCK.value), B * H), args, HEAD_DIM=D,
                  ROWS=QUERY_BLOCK.value), args


def backward(do, q, k, v, o, lse, dq, dk, dv, causal: bool, scale: float, tile: HopperBackwardTile,
             documents: tuple[torch.Tensor, torch.Tensor] | None = None,
             gathered: tuple[torch.Tensor, torch.Tensor] | None = None, term_args: tuple = (None,) * 8,
             sink_rows: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> Launched:
    """dq, dk, dv (shaped like q, k, v; any strides) from dO; q, k, v, o, do as `supports` allows, lse (B, Hq, Tq)
    float32 from the forward. tile: (STAGES, DKDV_STAGED) from `tiles`. documents: (spans, ids) as forward takes
    them, the spans here per key (§14). gathered: (row_src, dq_acc) for a gathered problem as forward takes row_src
    (§11): its n query rows read q, dO, lse and Delta at their source rows, and add their dS K (unscaled, by atomics)
    into row row_src[i] of dq_acc, a zeroed float32 (B*Hq*T, D) the caller reads (finish_dq); dq is None, k and v the
    problem's keys as forward takes them, and dk, dv (1, 1, Tk, D) their gradients as one flat sequence. term_args:
    as forward takes them, §15's (softcap, slopes, stride_slopes_b, stride_slopes_h), two unused (the sinks come
    below) and §16's (dropout_p, seed), None for a term the call does not have. sink_rows: with sinks (Hq,) (not
    with softcap, and not gathered), float32 (B, Hq, Tq) that gets each query row's sum of P dP, for their gradient
    (§15, terms.sink_grad). -> Launched: the compiled main kernel and again(do, q, k, v, o, lse, dq, dk, dv, scale,
    *term values, documents=None), the same three launches for tensors shaped, strided and aligned like these (None
    for a gathered problem); the term values are forward.term_values(term_args)'s, then sink_rows and sinks where the
    call has them."""
    B, Hq, T, D = q.shape
    row_src, given_dq_acc = gathered or (None, None)
    Hkv, Tk, key_sizes = key_problem(k, row_src is not None, KEY_BLOCK.value)
    # the pre-pass's rows per query head, padded to whole tiles for the TMA loads (a gathered problem copies rows)
    T_pad = T if row_src is not None else triton.cdiv(T, QUERY_BLOCK.value) * QUERY_BLOCK.value
    rows_grid = (triton.cdiv(T, QUERY_BLOCK.value), B * Hq)
    # the query rows the main kernel walks: q's, or the gathered ones, of one batch entry and head as k and v then are
    B_rows, H_rows, Tq = (B, Hq, T) if row_src is None else (1, 1, row_src.shape[0])
    Tq_pad = T_pad if row_src is None else Tq
    device, grad_dtype = q.device, dk.dtype  # (again must not keep q or dk alive)
    group, programs = H_rows // Hkv, triton.cdiv(Tk, KEY_BLOCK.value) * B_rows * Hkv
    split = 1 if row_src is not None else key_head_split(programs, group, sm_count(device))

    def buffers(with_dq=True):
        """lse, Delta (B*Hq*T_pad,) and the float32 dQ (B*Hq*T_pad, D) (or None), which the pre-pass writes; and
        with a split the partial dK, dV (B, Hkv * split, Tk, D) the main kernel writes (or None, None)"""
        lse_row = torch.empty(B * Hq * T_pad, dtype=torch.float32, device=device)
        dq_acc = torch.empty(B * Hq * T_pad, D, dtype=torch.float32, device=device) if with_dq else None
        parts = [torch.empty(B, Hkv * split, Tk, D, dtype=grad_dtype, device=device) if split > 1 else None
                 for _ in "kv"]
        return lse_row, torch.empty_like(lse_row), dq_acc, *parts
    lse_row, delta_row, dq_acc, dk_part, dv_part = buffers(with_dq=row_src is None)
    dk_out, dv_out = (dk_part, dv_part) if split > 1 else (dk, dv)  # what the main kernel writes
    rows_first = row_values_first(D)

    def lse_unit(scale, values):  # the kernel subtracts lse from S^T in the scores' units (score_terms: 1 / scale, or
        # 1 / softcap with softcap, the first of a call's term values where it has one), or from S^T times their
        # unit, in base 2 (§8)
        return 1 / (values[0] if term_args[0] is not None else scale) if rows_first else LOG2E.value
    sizes_prepare = (*o.stride()[:3], *do.stride()[:3], Hq, T, T_pad)
    unit = lse_unit(scale, term_values(term_args))
    # §15 ALiBi under the causal mask, folded: the pre-pass adds each row's part of the bias into its lse row
    fold = alibi_causal(causal, term_args, row_src)

    def prepare_slopes(term_args):  # the pre-pass's SLOPES and strides: the slopes' where folded, else None
        return tuple(term_args[1:4]) if fold else (None,) * 3
    prepare_args = (o, do, lse, lse_row, delta_row, dq_acc, sink_rows, sinks, *sizes_prepare, unit,
                    *prepare_slopes(term_args))
    first_prepare = launch(attn_bwd_prepare, rows_grid, prepare_args, HEAD_DIM=D, ROWS=QUERY_BLOCK.value)
    # K, V swizzled in atoms of D/2 columns (D bytes of 16-bit elements), as attn_bwd_ws lays them out
    k_desc, v_desc = (descriptor(t, KEY_BLOCK.value, swizzle=D) for t in (k, v))
    if row_src is None:
        q_desc, do_desc = (descriptor(t, QUERY_BLOCK.value) for t in (q, do))
        lse_desc, delta_desc = (TensorDescriptor(t, [t.numel()], [1], [QUERY_BLOCK.value], ROW_LAYOUT.value)
                                for t in (lse_row, delta_row))
        # the float32 dQ buffer's rows, added into by (QUERY_BLOCK, dq_cols) blocks by the copy engine
        dq_block = (QUERY_BLOCK.value, dq_cols(D))
        dq_desc = TensorDescriptor(dq_acc, list(dq_acc.shape), [D, 1], list(dq_block),
                                   shared_layout(dq_block, torch.float32))
        rows_args = (q_desc, do_desc, lse_desc, delta_desc, dq_desc)
        sources = (None, 0, 0, 0, 0, 0, 0, 0, 0)
    else:
        rows_args = (q, do, lse_row, delta_row, given_dq_acc)
        sources = (row_src, *q.stride()[:3], *do.stride()[:3], Hq, T)
    # programs go head group by head group, so that a group's float32 dQ rows (and its Q, dO) stay in L2
    heads_per_group = max(1, DQ_GROUP_BYTES // (group // split * Tq_pad * D * 4))
    diag = Tk - Tq if causal else Tk  # §6: row i sees keys <= i + diag (and < Tk)
    grad_strides = (*dk_out.stride()[:3], *dv_out.stride()[:3])
    # DK, DV: the gradients, or with a staged tile descriptors of (1, 1, 64, D) blocks swizzled as the K and V rows
    # they are staged in
    stages, staged = tile
    dkdv = [descriptor(t, KEYS.value, swizzle=D) for t in (dk_out, dv_out)] if staged else [dk_out, dv_out]
    # split kv heads: Hkv * split per batch entry, each with group / split query heads
    sizes_main = (Hkv * split, group // split, B_rows * Hkv * split, heads_per_group, Tq, Tq_pad, Tk, diag)
    main_grid = (programs * split,)
    main_args = (k_desc, v_desc, *rows_args[:4], *dkdv, *grad_strides, rows_args[4], *sources, *sizes_main, scale,
                 *document_args(documents), *term_args[:4], sink_rows, *term_args[6:], *key_sizes, split)
    first_main = launch(attn_bwd_ws, main_grid, main_args, STAGES=stages, ROWS_FIRST=rows_first, num_warps=4,
                        maxnreg=BACKWARD_LAUNCH_REGS, **fold)
    if row_src is not None:  # the caller reads its buffer
        return Launched(first_main.compiled, None)
    first_finish, finish_args = finish_dq(dq_acc, dq, T_pad, scale)
    launches = [(first_prepare, prepare_args), (first_main, main_args), (first_finish, finish_args)]
    first_sum = None
    if split > 1:
        first_sum, sum_args = sum_key_parts(dk_part, dv_part, dk, dv, split)
        launches.append((first_sum, sum_args))
    values = term_values(term_args)
    n_terms = len(values)  # (again must not keep the sinks alive: it takes them from values_now)
    values += (sink_rows, sinks) if sinks is not None else ()
    # a later call fills its tensors' places in these arguments (launch.planned; a descriptor's place takes its tensor,
    # launch.BoundLaunch), so again keeps no tensor of this call
    first_call = (do, q, k, v, o, lse, dq, dk, dv, scale, lse_row, delta_row, dq_acc, dk_part, dv_part, unit, *values,
                  *(documents or ()))
    plans = [planned(first.again, args, first_call) for first, args in launches]
    if any(plan is None for plan in plans):  # inputs that alias: each call's arguments anew
        def again(do, q, k, v, o, lse, dq, dk, dv, scale, *values_now, documents=None):
            lse_row, delta_row, dq_acc, dk_part, dv_part = buffers()
            terms_now = with_term_values(term_args, values_now[:n_terms])
            sink_rows_now, sinks_now = values_now[n_terms:] or (None, None)
            first_prepare.again(o, do, lse, lse_row, delta_row, dq_acc, sink_rows_now, sinks_now, *sizes_prepare,
                                lse_unit(scale, values_now), *prepare_slopes(terms_now))
            dk_out, dv_out = (dk_part, dv_part) if split > 1 else (dk, dv)
            first_main.again(k, v, q, do, lse_row, delta_row, dk_out, dv_out, *grad_strides, dq_acc, *sources,
                             *sizes_main, scale, *document_args(documents), *terms_now[:4], sink_rows_now,
                             *terms_now[6:], *key_sizes, split)
            first_finish.again(dq_acc, dq, *dq.stride()[:3], Hq, T, T_pad, scale)
            if first_sum is not None:
                first_sum.again(dk_part, dv_part, dk, dv, *dk.stride()[:3], *dv.stride()[:3], Hkv, Tk, split)
    else:
        def again(do, q, k, v, o, lse, dq, dk, dv, scale, *values_now, documents=None):
            call = (do, q, k, v, o, lse, dq, dk, dv, scale, *buffers(), lse_unit(scale, values_now), *values_now,
                    *(documents or ()))
            for plan in plans:
                plan(*call)
    return Launched(first_main.compiled, again)
