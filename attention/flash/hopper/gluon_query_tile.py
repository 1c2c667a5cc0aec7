"""A consumer warpgroup's query tile in the Hopper backward (gluon_backward._key_gradients, §13), phase by phase:
the rows its keys' documents hold (§14), the tile's ALiBi slope (§15), S^T and dP^T issued, the scores as the
forward made them and masked (§6, §15), P^T (§8), the sinks' rows (§15), its half of dS^T shared for dQ, and at the
end dK and dV stored.
Gluon inlines each of these where it is called: split into them, the sm_90 builds compile to the same SASS
(docs/perf_notes.md section 12).

Imported only where Gluon exists (device.HAS_GLUON), as gluon_common.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .gluon_common import document_span, same_document, tma_store
from .gluon_dq import dq_product
from .shapes import KEY_BLOCK, KEYS, QUERY_BLOCK


@gluon.jit
def query_tile(t, bh_kv, GROUP, first_m, per_head):
    """A program's t-th query tile -> (the query head's batch*head index, first row): per_head tiles from
    first_m on for each query head of the kv head's group in turn (§7)."""
    return bh_kv * GROUP + t // per_head, (first_m + t % per_head) * QUERY_BLOCK

@gluon.jit
def document_rows(SPANS, IDS, b, first_key, Tq, Tk):
    """§14 documents: the first row every key's document holds and the end of the first key's: query tiles
    reaching before or past them are masked (all of them where the ids are not runs); without SPANS 0 and Tq.
    The rows' spans are read for masked tiles only, few of them, so that only these two stay in registers over
    the loop."""
    rows_from, rows_end = 0, Tq
    if SPANS is not None:
        rows_from, _ = document_span(SPANS, b, gl.minimum(first_key + KEYS, Tk) - 1, Tk)
        if IDS is not None:
            rows_from = gl.where(gl.load(SPANS + b.to(gl.int64) * 2 * Tk) == 0, rows_from, Tq)  # not runs: all
        _, rows_end = document_span(SPANS, b, gl.minimum(first_key, Tk - 1), Tk)
    return rows_from, rows_end

@gluon.jit
def query_slope(SLOPES, bh, b, H_kv, GROUP, stride_slopes_b, stride_slopes_h, unit):
    """§15 the ALiBi slope of query head bh (batch*head), in the scores' units (score_terms): slope * LOG2E / unit."""
    h_q = bh - b * H_kv * GROUP
    return gl.load(SLOPES + b * stride_slopes_b + h_q * stride_slopes_h).to(gl.float32) * (1.4426950408889634 / unit)

@gluon.jit
def issue_scores(k_mine, v_mine, q, do, zeros, lse_row, delta_smem, SOFTCAP: gl.constexpr, LATE_DP: gl.constexpr,
                 ROWS_FIRST: gl.constexpr):
    """S^T = K Q^T and dP^T = V dO^T of the warpgroup's keys and the tile's rows, issued together (with LATE_DP
    dP^T later, beside dV: _key_gradients). With ROWS_FIRST (hs=128) S^T and dP^T start from -lse / scale and
    -Delta instead of zero and come out with them subtracted: the (M,) values are spent before the wgmmas are
    issued, and take no registers over the exp2s and dS, where the consumer's registers peak (row_values_first).
    -> (S^T (KEYS, M) once in, dP^T's token, still running; 0 with LATE_DP)."""
    if SOFTCAP:  # §15 S^T itself, capped before lse is subtracted; dP^T from zero, or with LATE_DP later
        st_token = warpgroup_mma(k_mine, q.permute((1, 0)), zeros, use_acc=False, is_async=True)
        if not LATE_DP:
            dpt_token = warpgroup_mma(v_mine, do.permute((1, 0)), zeros, use_acc=False, is_async=True)
    elif ROWS_FIRST:
        delta = delta_smem.load(lse_row.type.layout)  # (M,)
        st_token = warpgroup_mma(k_mine, q.permute((1, 0)), zeros - lse_row[None, :], is_async=True)
        dpt_token = warpgroup_mma(v_mine, do.permute((1, 0)), zeros - delta[None, :], is_async=True)
    else:
        st_token = warpgroup_mma(k_mine, q.permute((1, 0)), zeros, use_acc=False, is_async=True)
        dpt_token = warpgroup_mma(v_mine, do.permute((1, 0)), zeros, use_acc=False, is_async=True)
    if LATE_DP:  # no dP^T token: 0 in its place (Triton 3.6 returns no None from a function), never read
        return warpgroup_mma_wait(0, deps=[st_token]), 0
    else:
        return warpgroup_mma_wait(1, deps=[st_token]), dpt_token  # S^T (KEYS, M), less lse / scale if ROWS_FIRST

@gluon.jit
def masked_scores(st, keys, start_m, rows_m, first_key, diag, Tk, rows_from, rows_end, b, SPANS, IDS, stride_ids):
    """S^T (KEYS, M) of keys `keys` and query rows start_m + rows_m with -inf where a row does not see a key.
    §6 key <= min(row + diag, Tk - 1): only tiles crossing the diagonal or the ragged last key need it; §14 and,
    with documents, tiles crossing a document's edge (rows_from, rows_end: document_rows)."""
    DOCUMENTS: gl.constexpr = SPANS is not None
    masked = first_key + KEYS - 1 > gl.minimum(start_m + diag, Tk - 1)
    if DOCUMENTS:
        masked = masked | (start_m < rows_from) | (start_m + QUERY_BLOCK > rows_end)
    if masked:
        rows = start_m + rows_m  # (M,)
        visible = keys[:, None] <= gl.minimum(rows + diag, Tk - 1)[None, :]
        if DOCUMENTS:
            visible = visible & same_document(keys, rows, b, Tk, SPANS, IDS, stride_ids)
        st = gl.where(visible, st, float("-inf"))
    return st

@gluon.jit
def probabilities(st, lse_row, lse_smem, unit, SOFTCAP: gl.constexpr, LATE_DP: gl.constexpr,
                  ROWS_FIRST: gl.constexpr):
    """§8 P^T = exp2(unit * S^T - lse in base 2) (KEYS, M), S^T in score_terms' units; 0 in padding rows (lse +inf).
    With ROWS_FIRST (not softcap) S^T comes with lse / scale subtracted already."""
    if LATE_DP:  # §15 softcap at hs=128: lse / softcap subtracted after the cap, read from shared memory here
        # rather than held in registers since the top of the tile (§13 "The row values in the accumulators")
        pt = gl.exp2((st - lse_smem.load(lse_row.type.layout)[None, :]) * unit)
    elif SOFTCAP:  # at hs=64, lse in base 2
        pt = gl.exp2(st * unit - lse_row[None, :])
    else:
        pt = gl.exp2(st * unit) if ROWS_FIRST else gl.exp2(st * unit - lse_row[None, :])
    return pt

@gluon.jit
def issue_dv_wait_dp(pt, tt, v_mine, do, dv, zeros, dpt_token, delta_smem, DROPOUT: gl.constexpr,
                     SOFTCAP: gl.constexpr, LATE_DP: gl.constexpr, ROWS_FIRST: gl.constexpr):
    """dV += P^T dO issued, and dP^T - Delta (KEYS, M) once in (with LATE_DP issued here, before dV, so that the
    wait is for it). With softcap P^T takes 1 - tanh^2 (tt: tanh, score_terms) while dP^T runs, as dS^T needs it.
    DROPOUT: §16's dropped entries of P^T come negated (_key_gradients), and dV takes the kept ones. -> (dV's token,
    still running; P^T as dS^T takes it; dP^T - Delta)."""
    lhs_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv.type.layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(0, zeros.type.layout)  # a value per column of S^T: per query row
    if DROPOUT:
        pt_op = gl.convert_layout(gl.maximum(pt, 0.0).to(do.dtype), lhs_layout)
    else:
        pt_op = gl.convert_layout(pt.to(do.dtype), lhs_layout)
    if LATE_DP:  # §15 dP^T - Delta issued before dV, so that the wait below is for it
        delta = delta_smem.load(row_layout)  # (M,)
        dpt_token = warpgroup_mma(v_mine, do.permute((1, 0)), zeros - delta[None, :], is_async=True)
        dv_token = warpgroup_mma(pt_op, do, dv, is_async=True)  # dV += P^T dO
        pt = pt * (1.0 - tt * tt)  # softcap's 1 - tanh^2 (below)
        dpt = warpgroup_mma_wait(1, deps=[dpt_token])  # dP^T - Delta (KEYS, M); dV may still be running
    else:
        dv_token = warpgroup_mma(pt_op, do, dv, is_async=True)  # dV += P^T dO
        if SOFTCAP:  # §15 through softcap * tanh(s / softcap): dS^T takes 1 - tanh^2, folded into P^T now (its
            pt = pt * (1.0 - tt * tt)  # operand is issued) so that one (KEYS, M) tile, not two, waits for dP^T
        if ROWS_FIRST:
            dpt = warpgroup_mma_wait(1, deps=[dpt_token])  # dP^T - Delta (KEYS, M); dV may still be running
        else:  # Delta loaded here, not with lse: held over the exp2s it pushes scalars out (§13)
            delta = delta_smem.load(row_layout)  # (M,)
            dpt = warpgroup_mma_wait(1, deps=[dpt_token]) - delta[None, :]
    return dv_token, pt, dpt

@triton.constexpr_function
def keys_in_registers(m):
    """The layout of a warpgroup's S^T keys as (warp, key bits 0-2) by m queries with the keys in registers: the
    lanes that hold key bits 0-2 in a wgmma accumulator (lane bits 2-4) hold the queries' bits 0, 3 and 4 instead,
    lane bits 0-1 their bits 1-2 as there. A sum over the keys is then a thread's own, and its result lies in one
    thread, not in the 8 a sum across lanes leaves it in."""
    registers = [[0, 1, 0], [0, 2, 0], [0, 4, 0]] + [[0, 0, 1 << bit] for bit in range(5, m.bit_length() - 1)]
    lanes = [[0, 0, 2], [0, 0, 4], [0, 0, 1], [0, 0, 8], [0, 0, 16]]
    return gl.DistributedLinearLayout(registers, lanes, [[1, 0, 0], [2, 0, 0]], [], [4, 8, m])

@gluon.jit
def add_sink_rows(dst, SINK_ROWS, bh, start_m, Tq):
    """§15 the sinks' rows: this tile's part of each query row's sum over keys of dS = P (dP - Delta), from dS^T
    (KEYS, M) in float32, added into SINK_ROWS (the rows of (B*Hq, Tq)), where the pre-pass put Delta (1 - P_sink):
    the sum of P dP over the row's keys then, whatever Delta's rounding (attn_bwd_prepare)."""
    # each warp adds its own 16 keys' sums: a sum across the warpgroup's warps would pass through shared memory and
    # a barrier; four relaxed atomics a row are stores the consumers do not wait on. A thread holds keys g and g + 8
    # of its warp's 16 (added first); the other 7 pairs' values come to it by one exchange within the warp
    # (keys_in_registers), where a sum across lanes takes three shuffles per value and leaves each sum in 8 lanes,
    # each issuing its atomic
    M: gl.constexpr = dst.shape[1]
    pairs = gl.sum(gl.reshape(dst, [4, 2, KEYS // 8, M]), axis=1)  # (4, 8, M): keys g + {0, 8} added
    per_warp = gl.sum(gl.convert_layout(pairs, keys_in_registers(M)), axis=1)  # (4, M): rows of keys by warp
    queries = start_m + gl.arange(0, dst.shape[1], layout=gl.SliceLayout(0, per_warp.type.layout))  # (M,)
    rows, _ = gl.broadcast(queries[None, :], per_warp)  # (4, M)
    gl.atomic_add(SINK_ROWS + bh.to(gl.int64) * Tq + rows, per_warp, mask=rows < Tq, sem="relaxed")  # no fences

@gluon.jit
def share_ds(dst, ds_smem, ds_ready, ds_empty, t, WG: gl.constexpr):
    """The warpgroup's half of query tile t's dS^T into its buffer t % 2, once that is free (dQ needs both halves:
    dQ = dS K over all 128 keys), and announced on ds_ready."""
    buf = t % 2
    mbarrier.wait(ds_empty.index(buf), ((t // 2) & 1) ^ 1)
    ds_smem.index(buf).slice(WG * KEYS, KEYS).store(dst)
    # the stores, visible to the other warpgroup's wgmma before it reads them; the fence also orders this
    # slot's lse and Delta reads (generic proxy) before the copy engine's refill of it (async proxy)
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(buf), count=1)

@gluon.jit
def issue_dq(u, ds_smem, k_dq, ds_ready, bh_kv, GROUP, first_m, per_head):
    """The warpgroup's dQ of query tile u issued (dq_product; k_dq: the columns of K it computes), and where it
    goes, read while the wgmma runs: the query head and first row (a gathered problem's caller reads its rows'
    targets too, dq_targets: Triton 3.6 returns no None from a function, which the targets are without one).
    -> (the wgmma's token, the query head's batch*head, first row)."""
    dq_token = dq_product(u, ds_smem, k_dq, ds_ready)
    bh_u, start_u = query_tile(u, bh_kv, GROUP, first_m, per_head)
    return dq_token, bh_u, start_u

@gluon.jit
def rows_of(kv_smem, WG: gl.constexpr):
    """Warpgroup WG's 64 key rows of a (KEY_BLOCK, D) K or V tile, as the (1, 1, 64, D) block a descriptor of
    (B, H, T, D) copies (reshaped before sliced: Gluon cannot reshape a slice)."""
    return kv_smem.reshape([1, 1, KEY_BLOCK, kv_smem.shape[1]]).slice(WG * KEYS, KEYS, dim=2)

@gluon.jit
def store_key_gradients(dk, dv, DK, DV, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
                        k_smem, v_smem, k_free, b, h_kv, first_key, Tk, scale, WG: gl.constexpr):
    """dK, dV of the keys warpgroup WG owns, first_key ... + 63 (rows past Tk not stored); dS was w.r.t.
    scale * QK^T, so dK takes the scale here."""
    kd_layout: gl.constexpr = dk.type.layout
    HEAD_DIM: gl.constexpr = dk.shape[1]
    if DK.dtype.is_ptr():  # from the accumulators' registers, by pointers
        rows = first_key + gl.arange(0, KEYS, layout=gl.SliceLayout(1, kd_layout))  # (KEYS,)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kd_layout))  # (D,)
        keep = (rows < Tk)[:, None]
        dk_ptrs = DK + b.to(gl.int64) * stride_dkb + h_kv * stride_dkh + rows.to(gl.int64)[:, None] * stride_dkt
        gl.store(dk_ptrs + cols[None, :], (dk * scale).to(DK.dtype.element_ty), mask=keep)
        dv_ptrs = DV + b.to(gl.int64) * stride_dvb + h_kv * stride_dvh + rows.to(gl.int64)[:, None] * stride_dvt
        gl.store(dv_ptrs + cols[None, :], dv.to(DV.dtype.element_ty), mask=keep)
    else:  # DK, DV are descriptors: staged in shared memory, stored by the copy engine (§13 "dK and dV leave")
        # dV where this warpgroup's V rows were: only its own matmuls read them, all done
        v_smem.slice(WG * KEYS, KEYS).store(dv.to(v_smem.dtype))
        fence_async_shared()  # the stores, visible to the copy engine
        tma_store(DV, [b, h_kv, first_key, 0], rows_of(v_smem, WG))
        # dK where its K rows were, once both warpgroups are past their last dQ matmul (which reads all keys)
        mbarrier.arrive(k_free, count=1)
        mbarrier.wait(k_free, 0)
        k_smem.slice(WG * KEYS, KEYS).store((dk * scale).to(k_smem.dtype))
        fence_async_shared()
        tma_store(DK, [b, h_kv, first_key, 0], rows_of(k_smem, WG))
        tma.store_wait(0)  # both read before the program's shared memory goes
