"""The `tl` forward (FlashAttention-2, docs/flash_attention.md §3, §4): a program per (query tile, batch*head)
walks the key tiles its rows see and keeps the online softmax (§2) of each row; it writes O and each row's
log-sum-exp, which the backward (tl_backward.py) recomputes P from.

With VARLEN (§14) batch entry b is sequence b of rows packed end to end (attention_varlen): each program reads
where its sequence starts and how long it is, then runs as a dense one on it. Which tile runs is the tuner's choice
(tuner.py, §9); when this kernel runs and when the Hopper one does is dispatch.py's. fwd_tile serves MoBA's kernels
too (moba/tl_kernels.py, §11).
"""
import triton
import triton.language as tl

from .tl_tiles import (ALIBI_FOLD, LN2, LOG2E, alibi_rows, dropout_first, dropout_keep, head_rows, head_slope,
                       key_ranges, listed_row, listed_tile, listed_tile_id, load_document_ids, load_tile,
                       query_tile_start, row_stats, rows_from, rule_visible, score_terms, sequence_bounds, store_tile,
                       tile_visible)


@triton.jit
def fwd_tile(acc, m_i, l_i, q, K, V, start_n, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols, Tk, qk_scale,
              visible, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, q_abs=None, softcap=None, slope2=None,
              SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False, cols_v=None, HEAD_DV: tl.constexpr = 0,
              drop=None, DROPOUT: tl.constexpr = False):
    """Fold the key tile k_pos = start_n, start_n + 1, ... (N,) into one query tile's running max m_i,
    running sum l_i and unnormalised output acc. visible: the (M, N) mask of a tile that needs one;
    None for a tile every row sees whole (then no mask is built and no load is bounds-checked).
    §15: q_abs (M, 1), softcap, slope2 and the SOFTCAP, ALIBI switches: score_terms'; cols_v, HEAD_DV: V's columns
    where its head dim is its own (None: cols and HEAD_DIM). §16 drop: (seed, row0, rows (M, 1), n_cols, dropout_p)
    of dropout_keep, with DROPOUT."""
    k = load_tile(K, start_n, k_pos, Tk, stride_kt, cols, stride_kd, HEAD_DIM, visible is not None)  # (N, D)
    if cols_v is None:
        v = load_tile(V, start_n, k_pos, Tk, stride_vt, cols, stride_vd, HEAD_DIM, visible is not None)  # (N, D)
    else:
        v = load_tile(V, start_n, k_pos, Tk, stride_vt, cols_v, stride_vd, HEAD_DV, visible is not None)  # (N, Dv)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (M, N), fp32 sums
    if SOFTCAP or ALIBI:
        # §15 the terms make the scores base-2 ones themselves (score_terms), and masked entries stay -inf after them
        qk, _ = score_terms(qk, q_abs, k_pos[None, :], qk_scale, softcap, slope2, SOFTCAP, ALIBI)
        unit = 1.0
    else:
        unit = qk_scale
    if visible is not None:
        qk = tl.where(visible, qk, float("-inf"))
    # §2 online softmax: move the running max, rescale what was summed under the old one.
    # §8 exp2: scores in base 2, s = q.k * scale * log2(e); the max commutes with that positive
    # factor, so scaling the row max and then qk * qk_scale - m is one fused multiply-add
    m_new = tl.maximum(m_i, tl.max(qk, 1) * unit)  # (M,)
    m_ref = m_new
    if visible is not None:
        # §8 fully-masked rows: a row that has seen no key keeps m = -inf; subtracting 0
        # instead keeps exp2(-inf - -inf) = NaN out of p and alpha (both become 0)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk * unit - m_ref[:, None])  # (M, N)
    alpha = tl.exp2(m_i - m_ref)  # (M,)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:  # §16 l sums every P; a dropped one weighs no value (attn_fwd scales the kept by 1 / (1 - p))
        seed, row0, rows, n_cols, dropout_p = drop
        p = tl.where(dropout_keep(seed, row0, rows, k_pos, n_cols, dropout_p), p, 0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # (M, D)
    return acc, m_new, l_i


@triton.jit
def attn_fwd(Q, K, V, O, LSE,
              stride_qb, stride_qh, stride_qt, stride_qd,
              stride_kb, stride_kh, stride_kt, stride_kd,
              stride_vb, stride_vh, stride_vt, stride_vd,
              stride_ob, stride_oh, stride_ot, stride_od,
              H, GROUP, Tq, Tk, scale,
              BLOCKS, stride_blocks_b, stride_blocks_h, n_blocks,
              window_left, window_right, DOC_IDS, stride_doc_b, TILE_BITS, CU_SEQLENS_Q, CU_SEQLENS_K,
              softcap, SLOPES, stride_slopes_b, stride_slopes_h, SINK_LOGITS, stride_sinks, dropout_p, SEED,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
              SPARSE: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, BITS: tl.constexpr,
              MASK_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, VARLEN: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
              SINKS: tl.constexpr = False, HEAD_DV: tl.constexpr = 0, BLOCK_DV: tl.constexpr = 0,
              DROPOUT: tl.constexpr = False):
    # §15 the terms (softcap, SLOPES, SINK_LOGITS and their strides are None where a switch is off) and V's own head
    # dim (HEAD_DV, BLOCK_DV; 0 where it is HEAD_DIM): V, O and the accumulator have V_DIM columns. §16 dropout_p and
    # SEED (the call's Philox seed, one int64) likewise None without DROPOUT
    V_DIM: tl.constexpr = HEAD_DV if HEAD_DV > 0 else HEAD_DIM
    BLOCK_V: tl.constexpr = BLOCK_DV if HEAD_DV > 0 else BLOCK_D
    # §15 ALiBi under the causal mask: the scores take the bias's key part alone, its row part goes into m and lse
    ALIBI_TERM: tl.constexpr = ALIBI_FOLD if ALIBI and CAUSAL else ALIBI
    start_m = query_tile_start(BLOCK_M, CAUSAL)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    q_start, k_start, seq_q, seq_k = sequence_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, b, Tq, Tk, VARLEN)
    LSE = row_stats(LSE, b, h, H, Tq, q_start, VARLEN)
    drop = None
    if DROPOUT:  # §16 the counters count the call's rows and k's rows (before Tq, Tk become this sequence's)
        n_cols = Tk
        seed, row0 = dropout_first(SEED, b, h, H, Tq, q_start, VARLEN)
    Tq, Tk = seq_q, seq_k
    if VARLEN:
        if start_m >= Tq:  # §14 the grid covers the longest sequence; this one is shorter
            return
    Q = rows_from(Q, q_start, stride_qt, VARLEN)
    K = rows_from(K, k_start, stride_kt, VARLEN)
    V = rows_from(V, k_start, stride_vt, VARLEN)
    O = rows_from(O, q_start, stride_ot, VARLEN)
    # §7 GQA: query head h reads kv head h // GROUP, GROUP = Hq // Hkv
    Q = head_rows(Q, b, h, stride_qb, stride_qh, stride_qt, Tq, HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
    K = head_rows(K, b, h // GROUP, stride_kb, stride_kh, stride_kt, Tk, HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
    V = head_rows(V, b, h // GROUP, stride_vb, stride_vh, stride_vt, Tk, V_DIM, BLOCK_V, BLOCK_N, TMA)
    O = head_rows(O, b, h, stride_ob, stride_oh, stride_ot, Tq, V_DIM, BLOCK_V, BLOCK_M, TMA)
    if DOCS:
        DOC_IDS += b.to(tl.int64) * stride_doc_b  # this batch row's document ids

    q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
    cols = tl.arange(0, BLOCK_D)  # (D,)
    cols_v = tl.arange(0, BLOCK_V)  # (Dv,): cols, unless V's head dim is its own
    q = load_tile(Q, start_m, q_pos, Tq, stride_qt, cols, stride_qd, HEAD_DIM, True)  # (M, D), on chip throughout
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    qk_scale = scale * LOG2E
    slope2 = head_slope(SLOPES, b, h, stride_slopes_b, stride_slopes_h, ALIBI)  # §15
    q_abs = None
    if ALIBI_TERM == ALIBI_FOLD:
        # §15 the fold's origin, the tile's first row's position among the keys: every score of row r exceeds its
        # true one by slope2 * (r - o) (alibi_rows), which m then carries too
        q_abs = start_m + Tk - Tq
    elif ALIBI:
        q_abs = (q_pos + Tk - Tq)[:, None]  # (M, 1) the rows' positions among the keys (§6)
    if SINKS:
        # §15 the sink: a key of score `sink` whose value is 0, folded in before the first tile as §2's state after
        # it: m = sink (base 2), l = exp2(sink - m) = 1, acc = 0 (a sink of -inf is no sink: l = 0); with ALiBi's
        # fold in the rows' folded units, as their scores are
        sink2 = tl.load(SINK_LOGITS + h * stride_sinks).to(tl.float32) * LOG2E
        m_i = tl.zeros([BLOCK_M], tl.float32) + sink2
        if ALIBI_TERM == ALIBI_FOLD:
            m_i += alibi_rows(slope2, BLOCK_M)
        l_i = tl.zeros([BLOCK_M], tl.float32) + (sink2 > float("-inf")).to(tl.float32)
    if DROPOUT:
        drop = (seed, row0, q_pos[:, None], n_cols, dropout_p)

    if SPARSE:
        # §10 block-sparse: the key blocks the block mask lists for this query block, the FULL ones
        # unmasked, then the PARTIAL ones masked; SKIP blocks are never loaded
        row, n_full, n_listed = listed_row(BLOCKS, b, h, stride_blocks_b, stride_blocks_h, start_m, n_blocks,
                                            MASK_BLOCK, BLOCK_N)
        for i in range(n_full):
            start_n = listed_tile(row, i, MASK_BLOCK, BLOCK_N)
            acc, m_i, l_i = fwd_tile(acc, m_i, l_i, q, K, V, start_n, start_n + tl.arange(0, BLOCK_N), stride_kt,
                                      stride_kd, stride_vt, stride_vd, cols, Tk, qk_scale, None, HEAD_DIM,
                                      DOT_PRECISION, q_abs, softcap, slope2, SOFTCAP, ALIBI_TERM, cols_v, V_DIM, drop,
                                      DROPOUT)
        q_doc = load_document_ids(DOC_IDS, q_pos[:, None], Tk - Tq, Tq, -1, DOCS)  # (M, 1)
        for i in range(n_full, n_listed):
            start_n = listed_tile(row, i, MASK_BLOCK, BLOCK_N)
            tile_id = listed_tile_id(row, i, n_blocks, BITS, MASK_BLOCK, BLOCK_N)
            k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
            k_doc = load_document_ids(DOC_IDS, k_pos[None, :], 0, Tk, -2, DOCS)  # (1, N)
            visible = tile_visible(q_pos[:, None], k_pos[None, :], Tq, Tk, window_left, window_right, q_doc, k_doc,
                               TILE_BITS, tile_id, CAUSAL, WINDOW, DOCS, BITS, MASK_BLOCK)
            acc, m_i, l_i = fwd_tile(acc, m_i, l_i, q, K, V, start_n, k_pos, stride_kt, stride_kd, stride_vt,
                                      stride_vd, cols, Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION, q_abs,
                                      softcap, slope2, SOFTCAP, ALIBI_TERM, cols_v, V_DIM, drop, DROPOUT)
    else:
        # §6: the tiles a window's left edge cuts, masked; the fully visible ones, unmasked; then the few at the
        # diagonal and the ends, masked
        lo, full_lo, full_end, end = key_ranges(start_m, Tq, Tk, window_left, window_right, BLOCK_M, BLOCK_N,
                                                CAUSAL, WINDOW)
        if WINDOW:  # without one, lo = full_lo = 0 and the dense kernels carry no such loop
            for start_n in range(lo, full_lo, BLOCK_N):
                k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
                visible = rule_visible(q_pos[:, None], k_pos[None, :], Tq, Tk, window_left, window_right, CAUSAL,
                                        WINDOW)
                acc, m_i, l_i = fwd_tile(acc, m_i, l_i, q, K, V, start_n, k_pos, stride_kt, stride_kd, stride_vt,
                                          stride_vd, cols, Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION, q_abs,
                                          softcap, slope2, SOFTCAP, ALIBI_TERM, cols_v, V_DIM, drop, DROPOUT)
        for start_n in range(full_lo, full_end, BLOCK_N):
            acc, m_i, l_i = fwd_tile(acc, m_i, l_i, q, K, V, start_n, start_n + tl.arange(0, BLOCK_N), stride_kt,
                                      stride_kd, stride_vt, stride_vd, cols, Tk, qk_scale, None, HEAD_DIM,
                                      DOT_PRECISION, q_abs, softcap, slope2, SOFTCAP, ALIBI_TERM, cols_v, V_DIM, drop,
                                      DROPOUT)
        for start_n in range(full_end, end, BLOCK_N):
            k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
            visible = rule_visible(q_pos[:, None], k_pos[None, :], Tq, Tk, window_left, window_right, CAUSAL, WINDOW)
            acc, m_i, l_i = fwd_tile(acc, m_i, l_i, q, K, V, start_n, k_pos, stride_kt, stride_kd, stride_vt,
                                      stride_vd, cols, Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION, q_abs,
                                      softcap, slope2, SOFTCAP, ALIBI_TERM, cols_v, V_DIM, drop, DROPOUT)

    # §4 log-sum-exp, saved for the backward pass, in natural log: lse = (m + log2 l) * ln 2.
    # §8 fully-masked rows: l = 0 -> output 0 and lse = +inf, so backward's exp2(s - lse) is 0.
    # §15 with a sink, l >= 1 and lse holds the sink's term: such a row's lse is the sink. With ALiBi's fold m is in
    # the folded units: less each row's bias part, lse is the true one (what return_lse and the backward read)
    if ALIBI_TERM == ALIBI_FOLD:
        m_i -= alibi_rows(slope2, BLOCK_M)
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("inf"))
    l_out = l_safe
    if DROPOUT:  # §16 the kept P scaled by 1 / (1 - p), once per row here
        l_out = l_safe * (1.0 - dropout_p)
    store_tile(O, acc / l_out[:, None], start_m, q_pos, Tq, stride_ot, cols_v, stride_od, V_DIM)
    tl.store(LSE + q_pos, lse, mask=q_pos < Tq)
