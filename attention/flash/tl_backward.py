"""The `tl` backward (FlashAttention-2, docs/flash_attention.md §5, §7), in the order a training step runs it:

  attn_bwd_dq     a program per (query tile, batch*head): dQ, and Delta = rowsum(dO * O) for its rows (§5)
  attn_bwd_dkdv   a program per (key tile, batch*kv_head): dK, dV summed over the query heads of its group (§5, §7);
                  reads the Delta the dQ kernel wrote

No atomics: each output element is written by exactly one program, in a fixed order, so the gradients are
bit-identical from run to run. dq_tile and dkdv_tile serve MoBA's kernels too (moba/tl_kernels.py, §11).
"""
import triton
import triton.language as tl

from .tl_tiles import (ALIBI_FOLD, LOG2E, alibi_rows, dropout_first, dropout_keep, head_base, head_slope,
                       key_ranges, listed_row, listed_tile, listed_tile_id, load_document_ids, load_rows, query_ranges,
                       query_tile_start, row_stats, rows_from, rule_visible, score_terms, sequence_bounds, store_rows,
                       tile_visible)


# ---------------------------------------------------------------------------------------------
# Backward (§5): dV = P^T dO, dP = dO V^T, dS = P * (dP - Delta), dQ = scale dS K, dK = scale dS^T Q
# with P recomputed tile by tile from the saved log-sum-exp.
# ---------------------------------------------------------------------------------------------
@triton.jit
def dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, q_pos, stride_qt, stride_qd, stride_dot, stride_dod, cols, Tq,
               qk_scale, visibleT, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, k_col=None, shift=None,
               softcap=None, slope2=None, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False, cols_v=None,
               HEAD_DV: tl.constexpr = 0, drop=None, DROPOUT: tl.constexpr = False):
    """Add the query tile q_pos (M,) of one head into a key tile's dK, dV. Computed transposed (keys
    as rows) so P^T and dS^T come out of tl.dot in the layout the next dot consumes. visibleT: the
    (N, M) mask, or None for a tile that needs none. §15: k_col (N, 1) the keys' positions, shift = Tk - Tq,
    softcap, slope2 and the SOFTCAP, ALIBI switches: score_terms'; with ALIBI_FOLD k_col and q_pos + shift are the
    keys' and the rows' positions past the origin (the key tile's first key): the scores take the keys' part of the
    bias, each row's lse its part, slope2 * (q_pos + shift), which its P then subtracts; cols_v, HEAD_DV: dO's and V's
    head dim is its own (None: cols and HEAD_DIM). §16 drop: (seed, row0, the keys' columns k_pos (N,), n_cols,
    dropout_p) of dropout_keep, with DROPOUT; the caller scales dV by 1 / (1 - p) once."""
    q = load_rows(Q, q_pos, Tq, stride_qt, cols, stride_qd, HEAD_DIM, visibleT is not None)  # (M, D)
    if cols_v is None:
        do = load_rows(DO, q_pos, Tq, stride_dot, cols, stride_dod, HEAD_DIM, visibleT is not None)  # (M, D)
    else:
        do = load_rows(DO, q_pos, Tq, stride_dot, cols_v, stride_dod, HEAD_DV, visibleT is not None)  # (M, Dv)
    # rows past Tq load lse = +inf, which makes their P (and so dS) exactly 0
    lse2 = tl.load(LSE + q_pos, mask=q_pos < Tq, other=float("inf")) * LOG2E  # (M,), base 2
    delta = tl.load(DELTA + q_pos, mask=q_pos < Tq, other=0.0)  # (M,)
    # §4: recompute P^T = exp2(s - lse) instead of having stored the (Tq, Tk) matrix
    kq = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (N, M)
    if ALIBI == ALIBI_FOLD:  # §15 the rows' part of the bias, in lse as the folded scores carry it (origin 0)
        sT, tT = score_terms(kq, 0, k_col, qk_scale, softcap, slope2, SOFTCAP, ALIBI)
        pT = tl.exp2(sT - (lse2 + slope2 * (q_pos + shift).to(tl.float32))[None, :])
    elif SOFTCAP or ALIBI:  # §15 the scores as the forward made them
        sT, tT = score_terms(kq, (q_pos + shift)[None, :], k_col, qk_scale, softcap, slope2, SOFTCAP, ALIBI)
        pT = tl.exp2(sT - lse2[None, :])
    else:
        pT = tl.exp2(kq * qk_scale - lse2[None, :])
    if visibleT is not None:
        pT = tl.where(visibleT, pT, 0.0)
    if DROPOUT:  # §16 dV += (P * Z)^T dO, the mask regenerated from the scores' counters
        seed, row0, k_pos, n_cols, dropout_p = drop
        keepT = tl.trans(dropout_keep(seed, row0, q_pos[:, None], k_pos, n_cols, dropout_p))  # (N, M)
        dv = tl.dot(tl.where(keepT, pT, 0.0).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    else:
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # dV += P^T dO   (N, D)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # dP^T = V dO^T        (N, M)
    if DROPOUT:  # §16 the gradient of the undropped P: dP * Z / (1 - p); Delta stays rowsum(dO * O)
        dpT = tl.where(keepT, dpT * (1.0 / (1.0 - dropout_p)), 0.0)
    dsT = pT * (dpT - delta[None, :])  # §5 softmax Jacobian: dS = P * (dP - Delta)       (N, M)
    if SOFTCAP:  # §15 through softcap * tanh(s / softcap): times 1 - tanh^2
        dsT = dsT * (1.0 - tT * tT)
    dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)  # dK += dS^T Q  (N, D)
    return dk, dv


@triton.jit
def attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA,
                   stride_qb, stride_qh, stride_qt, stride_qd,
                   stride_kb, stride_kh, stride_kt, stride_kd,
                   stride_vb, stride_vh, stride_vt, stride_vd,
                   stride_dob, stride_doh, stride_dot, stride_dod,
                   stride_dkb, stride_dkh, stride_dkt, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvt, stride_dvd,
                   H, GROUP, Tq, Tk, scale,
                   BLOCKS, stride_blocks_b, stride_blocks_h, n_blocks,
                   window_left, window_right, DOC_IDS, stride_doc_b, TILE_BITS, CU_SEQLENS_Q, CU_SEQLENS_K,
                   softcap, SLOPES, stride_slopes_b, stride_slopes_h, dropout_p, SEED,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                   SPARSE: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, BITS: tl.constexpr,
                   MASK_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr = False,
                   ALIBI: tl.constexpr = False, HEAD_DV: tl.constexpr = 0, BLOCK_DV: tl.constexpr = 0,
                   DROPOUT: tl.constexpr = False):
    # §15 as in attn_fwd: the terms' arguments None where a switch is off; V, dO and dV have V_DIM columns
    V_DIM: tl.constexpr = HEAD_DV if HEAD_DV > 0 else HEAD_DIM
    BLOCK_V: tl.constexpr = BLOCK_DV if HEAD_DV > 0 else BLOCK_D
    ALIBI_TERM: tl.constexpr = ALIBI_FOLD if ALIBI and CAUSAL else ALIBI  # §15 as in attn_fwd
    start_n = tl.program_id(0) * BLOCK_N
    bh_kv = tl.program_id(1)
    H_kv = H // GROUP
    b, h_kv = bh_kv // H_kv, bh_kv % H_kv
    q_start, k_start, seq_q, seq_k = sequence_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, b, Tq, Tk, VARLEN)
    stat_rows = Tq  # the length of a head's rows in LSE and DELTA
    n_cols = Tk  # §16 and of k's rows, which the dropout counters count
    Tq, Tk = seq_q, seq_k
    if VARLEN:
        if start_n >= Tk:  # §14 as in the forward
            return
    Q = rows_from(Q, q_start, stride_qt, VARLEN)
    DO = rows_from(DO, q_start, stride_dot, VARLEN)
    K = rows_from(K, k_start, stride_kt, VARLEN)
    V = rows_from(V, k_start, stride_vt, VARLEN)
    DK = rows_from(DK, k_start, stride_dkt, VARLEN)
    DV = rows_from(DV, k_start, stride_dvt, VARLEN)
    if DOCS:
        DOC_IDS += b.to(tl.int64) * stride_doc_b  # this batch row's document ids

    k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
    k_doc = load_document_ids(DOC_IDS, k_pos[:, None], 0, Tk, -2, DOCS)  # (N, 1)
    cols = tl.arange(0, BLOCK_D)  # (D,)
    cols_v = tl.arange(0, BLOCK_V)  # (Dv,)
    k = load_rows(head_base(K, b, h_kv, stride_kb, stride_kh), k_pos, Tk, stride_kt, cols, stride_kd,
                   HEAD_DIM, True)  # (N, D), on chip throughout
    v = load_rows(head_base(V, b, h_kv, stride_vb, stride_vh), k_pos, Tk, stride_vt, cols_v, stride_vd,
                   V_DIM, True)  # (N, Dv)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    qk_scale = scale * LOG2E
    k_col = None
    shift = Tk - Tq  # row i's position among the keys is i + shift (§6)
    if ALIBI_TERM == ALIBI_FOLD:  # §15 positions past the origin, this program's first key
        k_col = (k_pos - start_n)[:, None]  # (N, 1)
        shift = Tk - Tq - start_n
    elif ALIBI:
        k_col = k_pos[:, None]  # (N, 1), §15

    # §7 GQA gradient sum: every query head that reads this kv head adds into the same registers,
    # one head after the other, so no two programs write the same dK/dV rows (no atomics)
    for g in range(GROUP):
        h = h_kv * GROUP + g
        Qh = head_base(Q, b, h, stride_qb, stride_qh)
        DOh = head_base(DO, b, h, stride_dob, stride_doh)
        LSEh = row_stats(LSE, b, h, H, stat_rows, q_start, VARLEN)
        DELTAh = row_stats(DELTA, b, h, H, stat_rows, q_start, VARLEN)
        slope2 = head_slope(SLOPES, b, h, stride_slopes_b, stride_slopes_h, ALIBI)  # §15
        drop = None
        if DROPOUT:  # §16 query head h's counters
            seed, row0 = dropout_first(SEED, b, h, H, stat_rows, q_start, VARLEN)
            drop = (seed, row0, k_pos, n_cols, dropout_p)
        if SPARSE:
            # §10: the query blocks the block mask lists for this key block (and head), FULL then PARTIAL
            row, n_full, n_listed = listed_row(BLOCKS, b, h, stride_blocks_b, stride_blocks_h, start_n, n_blocks,
                                                MASK_BLOCK, BLOCK_M)
            for i in range(n_full):
                start_m = listed_tile(row, i, MASK_BLOCK, BLOCK_M)
                dk, dv = dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, start_m + tl.arange(0, BLOCK_M), stride_qt,
                                    stride_qd, stride_dot, stride_dod, cols, Tq, qk_scale, None, HEAD_DIM,
                                    DOT_PRECISION, k_col, shift, softcap, slope2, SOFTCAP, ALIBI_TERM, cols_v, V_DIM,
                                    drop, DROPOUT)
            for i in range(n_full, n_listed):
                start_m = listed_tile(row, i, MASK_BLOCK, BLOCK_M)
                tile_id = listed_tile_id(row, i, n_blocks, BITS, MASK_BLOCK, BLOCK_M)
                q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
                q_doc = load_document_ids(DOC_IDS, q_pos[None, :], Tk - Tq, Tq, -1, DOCS)  # (1, M)
                visibleT = tile_visible(q_pos[None, :], k_pos[:, None], Tq, Tk, window_left, window_right, q_doc, k_doc,
                                    TILE_BITS, tile_id, CAUSAL, WINDOW, DOCS, BITS, MASK_BLOCK)
                dk, dv = dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, q_pos, stride_qt, stride_qd, stride_dot,
                                    stride_dod, cols, Tq, qk_scale, visibleT, HEAD_DIM, DOT_PRECISION, k_col, shift,
                                    softcap, slope2, SOFTCAP, ALIBI_TERM, cols_v, V_DIM, drop, DROPOUT)
        else:
            # §6: query tiles on the diagonal masked, fully visible ones not, the ragged last one (and those a
            # window's left edge cuts, §14) masked
            lo, diag_end, full_end, end = query_ranges(start_n, Tq, Tk, window_left, window_right, BLOCK_M, BLOCK_N,
                                                        CAUSAL, WINDOW)
            for start_m in range(lo, diag_end, BLOCK_M):
                q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
                visibleT = rule_visible(q_pos[None, :], k_pos[:, None], Tq, Tk, window_left, window_right, CAUSAL,
                                         WINDOW)
                dk, dv = dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, q_pos, stride_qt, stride_qd, stride_dot,
                                    stride_dod, cols, Tq, qk_scale, visibleT, HEAD_DIM, DOT_PRECISION, k_col, shift,
                                    softcap, slope2, SOFTCAP, ALIBI_TERM, cols_v, V_DIM, drop, DROPOUT)
            for start_m in range(diag_end, full_end, BLOCK_M):
                dk, dv = dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, start_m + tl.arange(0, BLOCK_M), stride_qt,
                                    stride_qd, stride_dot, stride_dod, cols, Tq, qk_scale, None, HEAD_DIM,
                                    DOT_PRECISION, k_col, shift, softcap, slope2, SOFTCAP, ALIBI_TERM, cols_v, V_DIM,
                                    drop, DROPOUT)
            for start_m in range(full_end, end, BLOCK_M):
                q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
                visibleT = rule_visible(q_pos[None, :], k_pos[:, None], Tq, Tk, window_left, window_right, CAUSAL,
                                         WINDOW)
                dk, dv = dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, q_pos, stride_qt, stride_qd, stride_dot,
                                    stride_dod, cols, Tq, qk_scale, visibleT, HEAD_DIM, DOT_PRECISION, k_col, shift,
                                    softcap, slope2, SOFTCAP, ALIBI_TERM, cols_v, V_DIM, drop, DROPOUT)

    DK = head_base(DK, b, h_kv, stride_dkb, stride_dkh)
    DV = head_base(DV, b, h_kv, stride_dvb, stride_dvh)
    store_rows(DK, dk * scale, k_pos, Tk, stride_dkt, cols, stride_dkd, HEAD_DIM)  # dS was w.r.t. scale * QK^T
    if DROPOUT:  # §16 the kept P's 1 / (1 - p), once per element of dV
        dv = dv * (1.0 / (1.0 - dropout_p))
    store_rows(DV, dv, k_pos, Tk, stride_dvt, cols_v, stride_dvd, V_DIM)


@triton.jit
def dq_tile(dq, q, do, lse2, delta, K, V, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols, Tk, qk_scale,
             visible, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, q_abs=None, softcap=None, slope2=None,
             SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False, cols_v=None, HEAD_DV: tl.constexpr = 0,
             pdp=None, SINKS: tl.constexpr = False, drop=None, DROPOUT: tl.constexpr = False):
    """Add the key tile k_pos (N,) into one query tile's dQ; visible, and §15's q_abs ... HEAD_DV, as in fwd_tile (with
    ALIBI_FOLD lse2 holds the rows' part of the bias, as the forward's m did).
    pdp: each row's running sum of P * dP, which this tile adds to with SINKS (§15). -> dq, pdp. §16 drop: as
    fwd_tile's."""
    k = load_rows(K, k_pos, Tk, stride_kt, cols, stride_kd, HEAD_DIM, visible is not None)  # (N, D)
    if cols_v is None:
        v = load_rows(V, k_pos, Tk, stride_vt, cols, stride_vd, HEAD_DIM, visible is not None)  # (N, D)
    else:
        v = load_rows(V, k_pos, Tk, stride_vt, cols_v, stride_vd, HEAD_DV, visible is not None)  # (N, Dv)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (M, N)
    if SOFTCAP or ALIBI:  # §15 the scores as the forward made them
        s2, t = score_terms(qk, q_abs, k_pos[None, :], qk_scale, softcap, slope2, SOFTCAP, ALIBI)
        p = tl.exp2(s2 - lse2[:, None])
    else:
        p = tl.exp2(qk * qk_scale - lse2[:, None])  # (M, N)
    if visible is not None:
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (M, N)
    if DROPOUT:  # §16 as in dkdv_tile: dP * Z / (1 - p), from the same counters
        seed, row0, rows, n_cols, dropout_p = drop
        keep = dropout_keep(seed, row0, rows, k_pos, n_cols, dropout_p)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    if SINKS:  # §15 Delta as sum_j P dP, in fp32 from exact products (the sinks' gradient)
        pdp += tl.sum(p * dp, 1)
    ds = p * (dp - delta[:, None])  # §5 (M, N)
    if SOFTCAP:  # §15 softcap's chain rule, as in dkdv_tile
        ds = ds * (1.0 - t * t)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION), pdp  # dQ += dS K  (M, D)


@triton.jit
def attn_bwd_dq(Q, K, V, O, DO, DQ, LSE, DELTA,
                 stride_qb, stride_qh, stride_qt, stride_qd,
                 stride_kb, stride_kh, stride_kt, stride_kd,
                 stride_vb, stride_vh, stride_vt, stride_vd,
                 stride_ob, stride_oh, stride_ot, stride_od,
                 stride_dob, stride_doh, stride_dot, stride_dod,
                 stride_dqb, stride_dqh, stride_dqt, stride_dqd,
                 H, GROUP, Tq, Tk, scale,
                 BLOCKS, stride_blocks_b, stride_blocks_h, n_blocks,
                 window_left, window_right, DOC_IDS, stride_doc_b, TILE_BITS, CU_SEQLENS_Q, CU_SEQLENS_K,
                 softcap, SLOPES, stride_slopes_b, stride_slopes_h, dropout_p, SEED, SINK_ROWS,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                 SPARSE: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, BITS: tl.constexpr,
                 MASK_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
                 SINKS: tl.constexpr = False, HEAD_DV: tl.constexpr = 0, BLOCK_DV: tl.constexpr = 0,
                 DROPOUT: tl.constexpr = False):
    # §15 as in attn_fwd: the terms' arguments None where a switch is off; V, O and dO have V_DIM columns. With SINKS
    # the program also writes each row's sum of P * dP to SINK_ROWS (laid out as LSE), for the sinks' gradient
    V_DIM: tl.constexpr = HEAD_DV if HEAD_DV > 0 else HEAD_DIM
    BLOCK_V: tl.constexpr = BLOCK_DV if HEAD_DV > 0 else BLOCK_D
    ALIBI_TERM: tl.constexpr = ALIBI_FOLD if ALIBI and CAUSAL else ALIBI  # §15 as in attn_fwd
    start_m = query_tile_start(BLOCK_M, CAUSAL)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    q_start, k_start, seq_q, seq_k = sequence_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, b, Tq, Tk, VARLEN)
    LSE = row_stats(LSE, b, h, H, Tq, q_start, VARLEN)
    DELTA = row_stats(DELTA, b, h, H, Tq, q_start, VARLEN)
    if SINKS:
        SINK_ROWS = row_stats(SINK_ROWS, b, h, H, Tq, q_start, VARLEN)
    drop = None
    if DROPOUT:  # §16 as in the forward
        n_cols = Tk
        seed, row0 = dropout_first(SEED, b, h, H, Tq, q_start, VARLEN)
    Tq, Tk = seq_q, seq_k
    if VARLEN:
        if start_m >= Tq:  # §14 as in the forward
            return
    Q = rows_from(Q, q_start, stride_qt, VARLEN)
    O = rows_from(O, q_start, stride_ot, VARLEN)
    DO = rows_from(DO, q_start, stride_dot, VARLEN)
    DQ = rows_from(DQ, q_start, stride_dqt, VARLEN)
    K = rows_from(K, k_start, stride_kt, VARLEN)
    V = rows_from(V, k_start, stride_vt, VARLEN)
    K = head_base(K, b, h // GROUP, stride_kb, stride_kh)  # §7
    V = head_base(V, b, h // GROUP, stride_vb, stride_vh)
    if DOCS:
        DOC_IDS += b.to(tl.int64) * stride_doc_b  # this batch row's document ids

    q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
    cols = tl.arange(0, BLOCK_D)  # (D,)
    cols_v = tl.arange(0, BLOCK_V)  # (Dv,)
    q = load_rows(head_base(Q, b, h, stride_qb, stride_qh), q_pos, Tq, stride_qt, cols, stride_qd,
                   HEAD_DIM, True)  # (M, D), on chip throughout, like dO, lse and Delta
    do = load_rows(head_base(DO, b, h, stride_dob, stride_doh), q_pos, Tq, stride_dot, cols_v, stride_dod,
                    V_DIM, True)  # (M, Dv)
    lse2 = tl.load(LSE + q_pos, mask=q_pos < Tq, other=float("inf")) * LOG2E  # (M,)
    # §5 Delta_i = sum_j P_ij dP_ij = rowsum(dO * O)_i: one D-long dot product per row. This kernel
    # holds the rows' dO anyway, so it computes Delta here and stores it for the dK/dV kernel,
    # which runs next (a separate pre-pass would cost a launch and a second read of dO).
    o = load_rows(head_base(O, b, h, stride_ob, stride_oh), q_pos, Tq, stride_ot, cols_v, stride_od,
                   V_DIM, True)  # (M, Dv)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (M,)
    tl.store(DELTA + q_pos, delta, mask=q_pos < Tq)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E
    slope2 = head_slope(SLOPES, b, h, stride_slopes_b, stride_slopes_h, ALIBI)  # §15
    q_abs = None
    if ALIBI_TERM == ALIBI_FOLD:  # §15 as in attn_fwd: the origin, and the rows' part of the bias into lse, once
        q_abs = start_m + Tk - Tq
        lse2 += alibi_rows(slope2, BLOCK_M)
    elif ALIBI:
        q_abs = (q_pos + Tk - Tq)[:, None]  # (M, 1)
    pdp = tl.zeros([BLOCK_M], tl.float32)  # (M,) §15 each row's sum of P * dP, summed with SINKS only
    if DROPOUT:
        drop = (seed, row0, q_pos[:, None], n_cols, dropout_p)

    if SPARSE:  # §10, the same key blocks as the forward pass visited
        row, n_full, n_listed = listed_row(BLOCKS, b, h, stride_blocks_b, stride_blocks_h, start_m, n_blocks,
                                            MASK_BLOCK, BLOCK_N)
        for i in range(n_full):
            start_n = listed_tile(row, i, MASK_BLOCK, BLOCK_N)
            dq, pdp = dq_tile(dq, q, do, lse2, delta, K, V, start_n + tl.arange(0, BLOCK_N), stride_kt, stride_kd,
                               stride_vt, stride_vd, cols, Tk, qk_scale, None, HEAD_DIM, DOT_PRECISION, q_abs, softcap,
                               slope2, SOFTCAP, ALIBI_TERM, cols_v, V_DIM, pdp, SINKS, drop, DROPOUT)
        q_doc = load_document_ids(DOC_IDS, q_pos[:, None], Tk - Tq, Tq, -1, DOCS)  # (M, 1)
        for i in range(n_full, n_listed):
            start_n = listed_tile(row, i, MASK_BLOCK, BLOCK_N)
            tile_id = listed_tile_id(row, i, n_blocks, BITS, MASK_BLOCK, BLOCK_N)
            k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
            k_doc = load_document_ids(DOC_IDS, k_pos[None, :], 0, Tk, -2, DOCS)  # (1, N)
            visible = tile_visible(q_pos[:, None], k_pos[None, :], Tq, Tk, window_left, window_right, q_doc, k_doc,
                               TILE_BITS, tile_id, CAUSAL, WINDOW, DOCS, BITS, MASK_BLOCK)
            dq, pdp = dq_tile(dq, q, do, lse2, delta, K, V, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols,
                               Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION, q_abs, softcap, slope2, SOFTCAP,
                               ALIBI_TERM, cols_v, V_DIM, pdp, SINKS, drop, DROPOUT)
    else:
        lo, full_lo, full_end, end = key_ranges(start_m, Tq, Tk, window_left, window_right, BLOCK_M, BLOCK_N,
                                                CAUSAL, WINDOW)  # §6, as in the forward
        if WINDOW:  # as in the forward
            for start_n in range(lo, full_lo, BLOCK_N):
                k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
                visible = rule_visible(q_pos[:, None], k_pos[None, :], Tq, Tk, window_left, window_right, CAUSAL,
                                        WINDOW)
                dq, pdp = dq_tile(dq, q, do, lse2, delta, K, V, k_pos, stride_kt, stride_kd, stride_vt, stride_vd,
                                   cols, Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION, q_abs, softcap, slope2,
                                   SOFTCAP, ALIBI_TERM, cols_v, V_DIM, pdp, SINKS, drop, DROPOUT)
        for start_n in range(full_lo, full_end, BLOCK_N):
            dq, pdp = dq_tile(dq, q, do, lse2, delta, K, V, start_n + tl.arange(0, BLOCK_N), stride_kt, stride_kd,
                               stride_vt, stride_vd, cols, Tk, qk_scale, None, HEAD_DIM, DOT_PRECISION, q_abs, softcap,
                               slope2, SOFTCAP, ALIBI_TERM, cols_v, V_DIM, pdp, SINKS, drop, DROPOUT)
        for start_n in range(full_end, end, BLOCK_N):
            k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
            visible = rule_visible(q_pos[:, None], k_pos[None, :], Tq, Tk, window_left, window_right, CAUSAL, WINDOW)
            dq, pdp = dq_tile(dq, q, do, lse2, delta, K, V, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols,
                               Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION, q_abs, softcap, slope2, SOFTCAP,
                               ALIBI_TERM, cols_v, V_DIM, pdp, SINKS, drop, DROPOUT)
    if SINKS:
        tl.store(SINK_ROWS + q_pos, pdp, mask=q_pos < Tq)
    DQ = head_base(DQ, b, h, stride_dqb, stride_dqh)
    store_rows(DQ, dq * scale, q_pos, Tq, stride_dqt, cols, stride_dqd, HEAD_DIM)
