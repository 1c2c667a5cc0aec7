"""FlashAttention-2 in Triton's `tl`, written from the derivation in docs/flash_attention.md (§N below points to
its sections). The kernels, in the order a training step runs them:

  attn_fwd        a program per (query tile, batch*head): O and each row's log-sum-exp (§3, §4)
  attn_bwd_dq     a program per (query tile, batch*head): dQ, and Delta = rowsum(dO * O) for its rows (§5)
  attn_bwd_dkdv   a program per (key tile, batch*kv_head): dK, dV summed over the query heads of its group (§5, §7);
                  reads the Delta the dQ kernel wrote

With VARLEN (§14) batch entry b is sequence b of rows packed end to end (attention_varlen): each program reads
where its sequence starts and how long it is, then runs as a dense one on it.

No atomics: each output element is written by exactly one program, in a fixed order, so the gradients are
bit-identical from run to run. Which tile each kernel runs with is the tuner's choice (triton_tuner.py, §9); when
these kernels run and when the Hopper ones do is triton_dispatch.py's. The tile functions (fwd_tile, dq_tile,
dkdv_tile) serve MoBA's kernels too (triton_moba.py, §11), and the row loads the decode kernel (triton_decode.py).

Shape comments: M = BLOCK_M query rows, N = BLOCK_N key rows, D = BLOCK_D, the head dim padded to a power of two
(columns >= HEAD_DIM load as 0 and are never stored, so nothing is copied).
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) == exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # log(x) == log2(x) * LN2


# ---------------------------------------------------------------------------------------------
# Small pieces shared by every kernel
# ---------------------------------------------------------------------------------------------
@triton.jit
def head_base(ptr, b, h, stride_b, stride_h):
    # 64-bit: b * stride_b passes 2**31 for large batches of long sequences
    return ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def load_rows(base, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """(len(rows), D) tile of one head's (n_rows, HEAD_DIM) matrix. Padding columns read 0; rows
    past n_rows read 0 only with CHECK_ROWS, which tiles known to lie inside the sequence skip."""
    ptrs = base + rows[:, None] * stride_t + cols[None, :] * stride_d
    mask = cols[None, :] < HEAD_DIM
    if CHECK_ROWS:
        mask = mask & (rows[:, None] < n_rows)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def store_rows(base, tile, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM: tl.constexpr):
    ptrs = base + rows[:, None] * stride_t + cols[None, :] * stride_d
    mask = (rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM)
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _head_rows(ptr, b, h, stride_b, stride_h, stride_t, n_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK: tl.constexpr, TMA: tl.constexpr):
    """One head's (n_rows, HEAD_DIM) matrix as the tile loads read it (§9 TMA): a pointer to its first
    element, or with TMA a tensor descriptor whose loads are (BLOCK, BLOCK_D) copies done by Hopper's
    tensor memory accelerator: one instruction per tile instead of an address per element, no
    registers spent on addresses and masks, rows past n_rows and columns past HEAD_DIM read as 0."""
    base = head_base(ptr, b, h, stride_b, stride_h)
    if TMA:
        return tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride_t, 1],
                                         block_shape=[BLOCK, BLOCK_D])
    else:
        return base


@triton.jit
def _load_tile(src, start, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """The (len(rows), D) tile whose rows are start, start + 1, ...: from a descriptor (_head_rows) or,
    for a pointer, as load_rows."""
    if isinstance(src, tl.tensor_descriptor):
        return src.load([start, 0])
    else:
        return load_rows(src, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM, CHECK_ROWS)


@triton.jit
def _store_tile(dst, tile, start, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM: tl.constexpr):
    if isinstance(dst, tl.tensor_descriptor):
        dst.store([start, 0], tile.to(dst.dtype))  # rows past n_rows are not written
    else:
        store_rows(dst, tile, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM)


@triton.jit
def _visible(q_pos, k_pos, Tq, Tk, window_left, window_right, q_doc, k_doc, TILE_BITS, tile_id,
             CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, BITS: tl.constexpr,
             MASK_BLOCK: tl.constexpr):
    """True where query q_pos may attend to key k_pos (broadcast shapes, e.g. (M, 1) and (1, N)).
    Only tiles that need a mask call this: the AND of every rule the call uses (§6, §10). It runs on
    every score of a masked tile, so each rule costs as few integer ops per score as it can.
    Positions are bottom-right aligned: query i sits at absolute position i + Tk - Tq.
    q_doc, k_doc: the rows' document ids (_document_ids), shaped like q_pos and k_pos; None without DOCS."""
    q_abs = q_pos + (Tk - Tq)
    if CAUSAL:  # not in the query's future (for a real query, q_abs <= Tk - 1: so the key exists)
        mask = k_pos <= q_abs
    else:
        mask = k_pos < Tk  # the key exists
    if WINDOW:
        # §10 the window bounds how far the key lies behind the query: lo <= q_abs - k_pos <= window_left,
        # lo = -window_right (0 with causal). Read as unsigned, a distance below lo wraps around past
        # window_left - lo, so one subtraction and one compare per score test both ends (q_abs - lo
        # is per row) instead of two compares and an AND
        if CAUSAL:
            lo = 0
        else:
            lo = -window_right
        in_window = ((q_abs - lo) - k_pos).to(tl.uint32, bitcast=True) <= (window_left - lo).to(tl.uint32, bitcast=True)
        if CAUSAL:
            mask = in_window  # lo = 0 holds the causal rule
        else:
            mask = mask & in_window
    if DOCS:  # §10 documents: the same document
        mask = mask & (q_doc == k_doc)
    if BITS:  # §10 a mask function's partial block, evaluated once on the host: (MASK_BLOCK, MASK_BLOCK) bytes
        offset = tile_id.to(tl.int64) * MASK_BLOCK * MASK_BLOCK + (q_pos % MASK_BLOCK) * MASK_BLOCK + k_pos % MASK_BLOCK
        # tile_id -1 (the mask function sees this whole block; another rule made it partial) gives
        # offsets in [-MASK_BLOCK**2, 0): nothing to load, every pair visible
        mask = mask & (tl.load(TILE_BITS + offset, mask=offset >= 0, other=1) != 0)
    return mask


@triton.jit
def _rule_visible(q_pos, k_pos, Tq, Tk, window_left, window_right, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """_visible for the kernels' dense path: the causal rule, a varlen call's window (§14), the end of the keys."""
    return _visible(q_pos, k_pos, Tq, Tk, window_left, window_right, None, None, None, -1, CAUSAL, WINDOW, False,
                    False, 16)


@triton.jit
def _document_ids(DOC_IDS, pos, shift, n_rows, missing, DOCS: tl.constexpr):
    """§10: the document id at position pos + shift for rows pos < n_rows, `missing` for the others
    (-1 for queries, -2 for keys, so a missing row matches nothing). DOC_IDS points at this batch
    row's ids. A program loads its own rows' ids once, not once per tile; None without DOCS."""
    ids = None
    if DOCS:
        ids = tl.load(DOC_IDS + pos + shift, mask=(pos < n_rows) & (pos + shift >= 0), other=missing)
    return ids


@triton.jit
def key_ranges(start_m, Tq, Tk, window_left, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Keys a query tile [start_m, start_m + BLOCK_M) visits, as three ranges (§6 tile skipping): [lo, full_lo)
    need the mask (the window's left edge cuts into them, §14), [full_lo, full_end) are visible to every row (no
    mask), [full_end, end) need the mask (the diagonal, a window's right edge, the ragged end of the keys). Key
    tiles outside [lo, end) are never loaded."""
    first = start_m + Tk - Tq  # the tile's first row's position among the keys (bottom-right aligned)
    last = first + BLOCK_M - 1
    if CAUSAL:  # row a sees keys <= a: the first row bounds the whole tiles, the last row the end
        full_end = tl.maximum(first + 1, 0) // BLOCK_N * BLOCK_N  # first + 1 <= Tk for a tile of real queries
        end = tl.minimum(last + 1, Tk)
    elif WINDOW:  # and keys <= a + window_right
        full_end = tl.maximum(tl.minimum(first + window_right + 1, Tk), 0) // BLOCK_N * BLOCK_N
        end = tl.maximum(tl.minimum(last + window_right + 1, Tk), 0)
    else:
        full_end = Tk // BLOCK_N * BLOCK_N  # only a ragged last tile needs the mask
        end = Tk
    lo = 0
    full_lo = 0
    if WINDOW:  # row a sees keys >= a - window_left: the first row bounds what is loaded, the last what is whole
        lo = tl.maximum(first - window_left, 0) // BLOCK_N * BLOCK_N
        # a window narrower than a tile leaves no whole tile
        full_lo = tl.minimum(tl.cdiv(tl.maximum(last - window_left, 0), BLOCK_N) * BLOCK_N, full_end)
    return lo, full_lo, full_end, end


@triton.jit
def _query_ranges(start_n, Tq, Tk, window_left, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Queries that see a key tile [start_n, start_n + BLOCK_N), as three ranges (§6): [lo, diag_end) straddle
    the diagonal (mask), [diag_end, full_end) see the whole tile (no mask), [full_end, end) the ragged last query
    tile or, with a window (§14), the rows its left edge cuts off (mask). Query tiles outside [lo, end) see none of
    these keys: skipped. Row i sits at position i + Tk - Tq among the keys."""
    shift = Tk - Tq
    last = start_n + BLOCK_N - 1
    lo = 0
    diag_end = 0
    if CAUSAL or WINDOW:  # key j is seen from rows at j - right on (right = 0 with causal)
        right = 0
        if not CAUSAL:
            right = window_right
        lo = tl.maximum(start_n - right - shift, 0) // BLOCK_M * BLOCK_M
        # a query tile starting at or after the row that sees the tile's last key sees it all
        diag_end = tl.minimum(tl.cdiv(tl.maximum(last - right - shift, 0), BLOCK_M) * BLOCK_M, Tq)
    full_end = Tq // BLOCK_M * BLOCK_M
    end = Tq
    if WINDOW:  # and up to rows at j + window_left
        full_end = tl.maximum(tl.minimum(start_n + window_left - shift + 1, Tq), 0) // BLOCK_M * BLOCK_M
        end = tl.maximum(tl.minimum(last + window_left - shift + 1, Tq), 0)
    full_end = tl.maximum(diag_end, full_end)
    return lo, diag_end, full_end, end


@triton.jit
def _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, Tq, Tk, VARLEN: tl.constexpr):
    """§14 varlen: batch entry b is sequence b of the packed rows. -> its first query row, first key row and its
    Tq, Tk; for a dense call rows 0, 0 and the call's Tq, Tk."""
    q_start = 0
    k_start = 0
    if VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + b)
        Tq = tl.load(CU_SEQLENS_Q + b + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + b)
        Tk = tl.load(CU_SEQLENS_K + b + 1) - k_start
    return q_start, k_start, Tq, Tk


@triton.jit
def _rows_from(ptr, start, stride_t, VARLEN: tl.constexpr):
    """§14: ptr moved to row `start` of the packed rows (varlen); unchanged for a dense call."""
    if VARLEN:
        ptr += start.to(tl.int64) * stride_t
    return ptr


@triton.jit
def _row_stats(STATS, b, h, H, n_rows, q_start, VARLEN: tl.constexpr):
    """Head h's first row in a per-row float32 statistic (the log-sum-exp, Delta): (B, H, n_rows) for a dense
    call; (H, n_rows) for varlen (§14), n_rows then the packed query rows, sequence b's from q_start."""
    if VARLEN:
        return STATS + h.to(tl.int64) * n_rows + q_start
    else:
        return STATS + (b * H + h).to(tl.int64) * n_rows


@triton.jit
def _listed_row(BLOCKS, b, h, stride_b, stride_h, start, n_blocks, MASK_BLOCK: tl.constexpr, TILE: tl.constexpr):
    """§10: the block-mask row (see _listed_tile) of the block holding position start, for batch row b and
    head h, and how many TILE-wide tiles its FULL blocks and all its listed blocks hold: -> row, n_full, n_listed."""
    row = BLOCKS + b * stride_b + h * stride_h + (start // MASK_BLOCK) * (2 + 2 * n_blocks)
    return row, tl.load(row) * (MASK_BLOCK // TILE), tl.load(row + 1) * (MASK_BLOCK // TILE)


@triton.jit
def _listed_tile(row, i, MASK_BLOCK: tl.constexpr, TILE: tl.constexpr):
    """§10: the first position of the i-th tile of the blocks a block-mask row lists (row = [n_full,
    n_listed, blocks..., tile ids...], see attention/block_mask.py), counting TILE-wide tiles: each
    block holds MASK_BLOCK // TILE of them. One flat loop over tiles (not a loop per block) lets
    Triton's software pipelining prefetch across block boundaries."""
    TILES_PER_BLOCK: tl.constexpr = MASK_BLOCK // TILE
    return tl.load(row + 2 + i // TILES_PER_BLOCK) * MASK_BLOCK + (i % TILES_PER_BLOCK) * TILE


@triton.jit
def _listed_tile_id(row, i, n_blocks, BITS: tl.constexpr, MASK_BLOCK: tl.constexpr, TILE: tl.constexpr):
    """The stored-mask tile id of the block holding listed tile i (-1 without a mask function)."""
    tile_id = -1
    if BITS:
        tile_id = tl.load(row + 2 + n_blocks + i // (MASK_BLOCK // TILE))
    return tile_id


# ---------------------------------------------------------------------------------------------
# Forward (§2 online softmax, §3 tiling, §4 log-sum-exp)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _query_tile_start(BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """This program's first query row (§9 work order). Causal rows get longer down the sequence and
    the GPU starts programs in launch order, so the first programs take the last (longest) tiles:
    the short ones then fill the gaps at the end instead of a few long ones running on alone."""
    tile = tl.program_id(0)
    if CAUSAL:
        tile = tl.num_programs(0) - 1 - tile
    return tile * BLOCK_M


@triton.jit
def fwd_tile(acc, m_i, l_i, q, K, V, start_n, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols, Tk, qk_scale,
              visible, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold the key tile k_pos = start_n, start_n + 1, ... (N,) into one query tile's running max m_i,
    running sum l_i and unnormalised output acc. visible: the (M, N) mask of a tile that needs one;
    None for a tile every row sees whole (then no mask is built and no load is bounds-checked)."""
    k = _load_tile(K, start_n, k_pos, Tk, stride_kt, cols, stride_kd, HEAD_DIM, visible is not None)  # (N, D)
    v = _load_tile(V, start_n, k_pos, Tk, stride_vt, cols, stride_vd, HEAD_DIM, visible is not None)  # (N, D)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (M, N), fp32 sums
    if visible is not None:
        qk = tl.where(visible, qk, float("-inf"))
    # §2 online softmax: move the running max, rescale what was summed under the old one.
    # §8 exp2: scores in base 2, s = q.k * scale * log2(e); the max commutes with that positive
    # factor, so scaling the row max and then qk * qk_scale - m is one fused multiply-add
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # (M,)
    m_ref = m_new
    if visible is not None:
        # §8 fully-masked rows: a row that has seen no key keeps m = -inf; subtracting 0
        # instead keeps exp2(-inf - -inf) = NaN out of p and alpha (both become 0)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk * qk_scale - m_ref[:, None])  # (M, N)
    alpha = tl.exp2(m_i - m_ref)  # (M,)
    l_i = l_i * alpha + tl.sum(p, 1)
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
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
              SPARSE: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, BITS: tl.constexpr,
              MASK_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, VARLEN: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = _query_tile_start(BLOCK_M, CAUSAL)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    q_start, k_start, seq_q, seq_k = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, Tq, Tk, VARLEN)
    LSE = _row_stats(LSE, b, h, H, Tq, q_start, VARLEN)
    Tq, Tk = seq_q, seq_k
    if VARLEN:
        if start_m >= Tq:  # §14 the grid covers the longest sequence; this one is shorter
            return
    Q = _rows_from(Q, q_start, stride_qt, VARLEN)
    K = _rows_from(K, k_start, stride_kt, VARLEN)
    V = _rows_from(V, k_start, stride_vt, VARLEN)
    O = _rows_from(O, q_start, stride_ot, VARLEN)
    # §7 GQA: query head h reads kv head h // GROUP, GROUP = Hq // Hkv
    Q = _head_rows(Q, b, h, stride_qb, stride_qh, stride_qt, Tq, HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
    K = _head_rows(K, b, h // GROUP, stride_kb, stride_kh, stride_kt, Tk, HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
    V = _head_rows(V, b, h // GROUP, stride_vb, stride_vh, stride_vt, Tk, HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
    O = _head_rows(O, b, h, stride_ob, stride_oh, stride_ot, Tq, HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
    if DOCS:
        DOC_IDS += b.to(tl.int64) * stride_doc_b  # this batch row's document ids

    q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
    cols = tl.arange(0, BLOCK_D)  # (D,)
    q = _load_tile(Q, start_m, q_pos, Tq, stride_qt, cols, stride_qd, HEAD_DIM, True)  # (M, D), on chip throughout
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E

    if SPARSE:
        # §10 block-sparse: the key blocks the block mask lists for this query block, the FULL ones
        # unmasked, then the PARTIAL ones masked; SKIP blocks are never loaded
        row, n_full, n_listed = _listed_row(BLOCKS, b, h, stride_blocks_b, stride_blocks_h, start_m, n_blocks,
                                            MASK_BLOCK, BLOCK_N)
        for i in range(n_full):
            start_n = _listed_tile(row, i, MASK_BLOCK, BLOCK_N)
            acc, m_i, l_i = fwd_tile(acc, m_i, l_i, q, K, V, start_n, start_n + tl.arange(0, BLOCK_N), stride_kt,
                                      stride_kd, stride_vt, stride_vd, cols, Tk, qk_scale, None, HEAD_DIM, DOT_PRECISION)
        q_doc = _document_ids(DOC_IDS, q_pos[:, None], Tk - Tq, Tq, -1, DOCS)  # (M, 1)
        for i in range(n_full, n_listed):
            start_n = _listed_tile(row, i, MASK_BLOCK, BLOCK_N)
            tile_id = _listed_tile_id(row, i, n_blocks, BITS, MASK_BLOCK, BLOCK_N)
            k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
            k_doc = _document_ids(DOC_IDS, k_pos[None, :], 0, Tk, -2, DOCS)  # (1, N)
            visible = _visible(q_pos[:, None], k_pos[None, :], Tq, Tk, window_left, window_right, q_doc, k_doc,
                               TILE_BITS, tile_id, CAUSAL, WINDOW, DOCS, BITS, MASK_BLOCK)
            acc, m_i, l_i = fwd_tile(acc, m_i, l_i, q, K, V, start_n, k_pos, stride_kt, stride_kd, stride_vt,
                                      stride_vd, cols, Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION)
    else:
        # §6: the tiles a window's left edge cuts, masked; the fully visible ones, unmasked; then the few at the
        # diagonal and the ends, masked
        lo, full_lo, full_end, end = key_ranges(start_m, Tq, Tk, window_left, window_right, BLOCK_M, BLOCK_N,
                                                CAUSAL, WINDOW)
        if WINDOW:  # without one, lo = full_lo = 0 and the dense kernels carry no such loop
            for start_n in range(lo, full_lo, BLOCK_N):
                k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
                visible = _rule_visible(q_pos[:, None], k_pos[None, :], Tq, Tk, window_left, window_right, CAUSAL,
                                        WINDOW)
                acc, m_i, l_i = fwd_tile(acc, m_i, l_i, q, K, V, start_n, k_pos, stride_kt, stride_kd, stride_vt,
                                          stride_vd, cols, Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION)
        for start_n in range(full_lo, full_end, BLOCK_N):
            acc, m_i, l_i = fwd_tile(acc, m_i, l_i, q, K, V, start_n, start_n + tl.arange(0, BLOCK_N), stride_kt,
                                      stride_kd, stride_vt, stride_vd, cols, Tk, qk_scale, None, HEAD_DIM, DOT_PRECISION)
        for start_n in range(full_end, end, BLOCK_N):
            k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
            visible = _rule_visible(q_pos[:, None], k_pos[None, :], Tq, Tk, window_left, window_right, CAUSAL, WINDOW)
            acc, m_i, l_i = fwd_tile(acc, m_i, l_i, q, K, V, start_n, k_pos, stride_kt, stride_kd, stride_vt,
                                      stride_vd, cols, Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION)

    # §4 log-sum-exp, saved for the backward pass, in natural log: lse = (m + log2 l) * ln 2.
    # §8 fully-masked rows: l = 0 -> output 0 and lse = +inf, so backward's exp2(s - lse) is 0
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("inf"))
    _store_tile(O, acc / l_safe[:, None], start_m, q_pos, Tq, stride_ot, cols, stride_od, HEAD_DIM)
    tl.store(LSE + q_pos, lse, mask=q_pos < Tq)


# ---------------------------------------------------------------------------------------------
# Backward (§5): dV = P^T dO, dP = dO V^T, dS = P * (dP - Delta), dQ = scale dS K, dK = scale dS^T Q
# with P recomputed tile by tile from the saved log-sum-exp.
# ---------------------------------------------------------------------------------------------
@triton.jit
def dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, q_pos, stride_qt, stride_qd, stride_dot, stride_dod, cols, Tq,
               qk_scale, visibleT, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the query tile q_pos (M,) of one head into a key tile's dK, dV. Computed transposed (keys
    as rows) so P^T and dS^T come out of tl.dot in the layout the next dot consumes. visibleT: the
    (N, M) mask, or None for a tile that needs none."""
    q = load_rows(Q, q_pos, Tq, stride_qt, cols, stride_qd, HEAD_DIM, visibleT is not None)  # (M, D)
    do = load_rows(DO, q_pos, Tq, stride_dot, cols, stride_dod, HEAD_DIM, visibleT is not None)  # (M, D)
    # rows past Tq load lse = +inf, which makes their P (and so dS) exactly 0
    lse2 = tl.load(LSE + q_pos, mask=q_pos < Tq, other=float("inf")) * LOG2E  # (M,), base 2
    delta = tl.load(DELTA + q_pos, mask=q_pos < Tq, other=0.0)  # (M,)
    # §4: recompute P^T = exp2(s - lse) instead of having stored the (Tq, Tk) matrix
    pT = tl.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse2[None, :])  # (N, M)
    if visibleT is not None:
        pT = tl.where(visibleT, pT, 0.0)
    dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # dV += P^T dO   (N, D)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # dP^T = V dO^T        (N, M)
    dsT = pT * (dpT - delta[None, :])  # §5 softmax Jacobian: dS = P * (dP - Delta)       (N, M)
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
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                   SPARSE: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, BITS: tl.constexpr,
                   MASK_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh_kv = tl.program_id(1)
    H_kv = H // GROUP
    b, h_kv = bh_kv // H_kv, bh_kv % H_kv
    q_start, k_start, seq_q, seq_k = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, Tq, Tk, VARLEN)
    stat_rows = Tq  # the length of a head's rows in LSE and DELTA
    Tq, Tk = seq_q, seq_k
    if VARLEN:
        if start_n >= Tk:  # §14 as in the forward
            return
    Q = _rows_from(Q, q_start, stride_qt, VARLEN)
    DO = _rows_from(DO, q_start, stride_dot, VARLEN)
    K = _rows_from(K, k_start, stride_kt, VARLEN)
    V = _rows_from(V, k_start, stride_vt, VARLEN)
    DK = _rows_from(DK, k_start, stride_dkt, VARLEN)
    DV = _rows_from(DV, k_start, stride_dvt, VARLEN)
    if DOCS:
        DOC_IDS += b.to(tl.int64) * stride_doc_b  # this batch row's document ids

    k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
    k_doc = _document_ids(DOC_IDS, k_pos[:, None], 0, Tk, -2, DOCS)  # (N, 1)
    cols = tl.arange(0, BLOCK_D)  # (D,)
    k = load_rows(head_base(K, b, h_kv, stride_kb, stride_kh), k_pos, Tk, stride_kt, cols, stride_kd,
                   HEAD_DIM, True)  # (N, D), on chip throughout
    v = load_rows(head_base(V, b, h_kv, stride_vb, stride_vh), k_pos, Tk, stride_vt, cols, stride_vd,
                   HEAD_DIM, True)  # (N, D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E

    # §7 GQA gradient sum: every query head that reads this kv head adds into the same registers,
    # one head after the other, so no two programs write the same dK/dV rows (no atomics)
    for g in range(GROUP):
        h = h_kv * GROUP + g
        Qh = head_base(Q, b, h, stride_qb, stride_qh)
        DOh = head_base(DO, b, h, stride_dob, stride_doh)
        LSEh = _row_stats(LSE, b, h, H, stat_rows, q_start, VARLEN)
        DELTAh = _row_stats(DELTA, b, h, H, stat_rows, q_start, VARLEN)
        if SPARSE:
            # §10: the query blocks the block mask lists for this key block (and head), FULL then PARTIAL
            row, n_full, n_listed = _listed_row(BLOCKS, b, h, stride_blocks_b, stride_blocks_h, start_n, n_blocks,
                                                MASK_BLOCK, BLOCK_M)
            for i in range(n_full):
                start_m = _listed_tile(row, i, MASK_BLOCK, BLOCK_M)
                dk, dv = dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, start_m + tl.arange(0, BLOCK_M), stride_qt,
                                    stride_qd, stride_dot, stride_dod, cols, Tq, qk_scale, None, HEAD_DIM, DOT_PRECISION)
            for i in range(n_full, n_listed):
                start_m = _listed_tile(row, i, MASK_BLOCK, BLOCK_M)
                tile_id = _listed_tile_id(row, i, n_blocks, BITS, MASK_BLOCK, BLOCK_M)
                q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
                q_doc = _document_ids(DOC_IDS, q_pos[None, :], Tk - Tq, Tq, -1, DOCS)  # (1, M)
                visibleT = _visible(q_pos[None, :], k_pos[:, None], Tq, Tk, window_left, window_right, q_doc, k_doc,
                                    TILE_BITS, tile_id, CAUSAL, WINDOW, DOCS, BITS, MASK_BLOCK)
                dk, dv = dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, q_pos, stride_qt, stride_qd, stride_dot,
                                    stride_dod, cols, Tq, qk_scale, visibleT, HEAD_DIM, DOT_PRECISION)
        else:
            # §6: query tiles on the diagonal masked, fully visible ones not, the ragged last one (and those a
            # window's left edge cuts, §14) masked
            lo, diag_end, full_end, end = _query_ranges(start_n, Tq, Tk, window_left, window_right, BLOCK_M, BLOCK_N,
                                                        CAUSAL, WINDOW)
            for start_m in range(lo, diag_end, BLOCK_M):
                q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
                visibleT = _rule_visible(q_pos[None, :], k_pos[:, None], Tq, Tk, window_left, window_right, CAUSAL,
                                         WINDOW)
                dk, dv = dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, q_pos, stride_qt, stride_qd, stride_dot,
                                    stride_dod, cols, Tq, qk_scale, visibleT, HEAD_DIM, DOT_PRECISION)
            for start_m in range(diag_end, full_end, BLOCK_M):
                dk, dv = dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, start_m + tl.arange(0, BLOCK_M), stride_qt,
                                    stride_qd, stride_dot, stride_dod, cols, Tq, qk_scale, None, HEAD_DIM, DOT_PRECISION)
            for start_m in range(full_end, end, BLOCK_M):
                q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
                visibleT = _rule_visible(q_pos[None, :], k_pos[:, None], Tq, Tk, window_left, window_right, CAUSAL,
                                         WINDOW)
                dk, dv = dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, q_pos, stride_qt, stride_qd, stride_dot,
                                    stride_dod, cols, Tq, qk_scale, visibleT, HEAD_DIM, DOT_PRECISION)

    DK = head_base(DK, b, h_kv, stride_dkb, stride_dkh)
    DV = head_base(DV, b, h_kv, stride_dvb, stride_dvh)
    store_rows(DK, dk * scale, k_pos, Tk, stride_dkt, cols, stride_dkd, HEAD_DIM)  # dS was w.r.t. scale * QK^T
    store_rows(DV, dv, k_pos, Tk, stride_dvt, cols, stride_dvd, HEAD_DIM)


@triton.jit
def dq_tile(dq, q, do, lse2, delta, K, V, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols, Tk, qk_scale,
             visible, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the key tile k_pos (N,) into one query tile's dQ; visible as in fwd_tile."""
    k = load_rows(K, k_pos, Tk, stride_kt, cols, stride_kd, HEAD_DIM, visible is not None)  # (N, D)
    v = load_rows(V, k_pos, Tk, stride_vt, cols, stride_vd, HEAD_DIM, visible is not None)  # (N, D)
    p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])  # (M, N)
    if visible is not None:
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (M, N)
    ds = p * (dp - delta[:, None])  # §5 (M, N)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)  # dQ += dS K  (M, D)


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
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                 SPARSE: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, BITS: tl.constexpr,
                 MASK_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    start_m = _query_tile_start(BLOCK_M, CAUSAL)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    q_start, k_start, seq_q, seq_k = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, Tq, Tk, VARLEN)
    LSE = _row_stats(LSE, b, h, H, Tq, q_start, VARLEN)
    DELTA = _row_stats(DELTA, b, h, H, Tq, q_start, VARLEN)
    Tq, Tk = seq_q, seq_k
    if VARLEN:
        if start_m >= Tq:  # §14 as in the forward
            return
    Q = _rows_from(Q, q_start, stride_qt, VARLEN)
    O = _rows_from(O, q_start, stride_ot, VARLEN)
    DO = _rows_from(DO, q_start, stride_dot, VARLEN)
    DQ = _rows_from(DQ, q_start, stride_dqt, VARLEN)
    K = _rows_from(K, k_start, stride_kt, VARLEN)
    V = _rows_from(V, k_start, stride_vt, VARLEN)
    K = head_base(K, b, h // GROUP, stride_kb, stride_kh)  # §7
    V = head_base(V, b, h // GROUP, stride_vb, stride_vh)
    if DOCS:
        DOC_IDS += b.to(tl.int64) * stride_doc_b  # this batch row's document ids

    q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
    cols = tl.arange(0, BLOCK_D)  # (D,)
    q = load_rows(head_base(Q, b, h, stride_qb, stride_qh), q_pos, Tq, stride_qt, cols, stride_qd,
                   HEAD_DIM, True)  # (M, D), on chip throughout, like dO, lse and Delta
    do = load_rows(head_base(DO, b, h, stride_dob, stride_doh), q_pos, Tq, stride_dot, cols, stride_dod,
                    HEAD_DIM, True)  # (M, D)
    lse2 = tl.load(LSE + q_pos, mask=q_pos < Tq, other=float("inf")) * LOG2E  # (M,)
    # §5 Delta_i = sum_j P_ij dP_ij = rowsum(dO * O)_i: one D-long dot product per row. This kernel
    # holds the rows' dO anyway, so it computes Delta here and stores it for the dK/dV kernel,
    # which runs next (a separate pre-pass would cost a launch and a second read of dO).
    o = load_rows(head_base(O, b, h, stride_ob, stride_oh), q_pos, Tq, stride_ot, cols, stride_od,
                   HEAD_DIM, True)  # (M, D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (M,)
    tl.store(DELTA + q_pos, delta, mask=q_pos < Tq)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E

    if SPARSE:  # §10, the same key blocks as the forward pass visited
        row, n_full, n_listed = _listed_row(BLOCKS, b, h, stride_blocks_b, stride_blocks_h, start_m, n_blocks,
                                            MASK_BLOCK, BLOCK_N)
        for i in range(n_full):
            start_n = _listed_tile(row, i, MASK_BLOCK, BLOCK_N)
            dq = dq_tile(dq, q, do, lse2, delta, K, V, start_n + tl.arange(0, BLOCK_N), stride_kt, stride_kd,
                          stride_vt, stride_vd, cols, Tk, qk_scale, None, HEAD_DIM, DOT_PRECISION)
        q_doc = _document_ids(DOC_IDS, q_pos[:, None], Tk - Tq, Tq, -1, DOCS)  # (M, 1)
        for i in range(n_full, n_listed):
            start_n = _listed_tile(row, i, MASK_BLOCK, BLOCK_N)
            tile_id = _listed_tile_id(row, i, n_blocks, BITS, MASK_BLOCK, BLOCK_N)
            k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
            k_doc = _document_ids(DOC_IDS, k_pos[None, :], 0, Tk, -2, DOCS)  # (1, N)
            visible = _visible(q_pos[:, None], k_pos[None, :], Tq, Tk, window_left, window_right, q_doc, k_doc,
                               TILE_BITS, tile_id, CAUSAL, WINDOW, DOCS, BITS, MASK_BLOCK)
            dq = dq_tile(dq, q, do, lse2, delta, K, V, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols,
                          Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION)
    else:
        lo, full_lo, full_end, end = key_ranges(start_m, Tq, Tk, window_left, window_right, BLOCK_M, BLOCK_N,
                                                CAUSAL, WINDOW)  # §6, as in the forward
        if WINDOW:  # as in the forward
            for start_n in range(lo, full_lo, BLOCK_N):
                k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
                visible = _rule_visible(q_pos[:, None], k_pos[None, :], Tq, Tk, window_left, window_right, CAUSAL,
                                        WINDOW)
                dq = dq_tile(dq, q, do, lse2, delta, K, V, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols,
                              Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION)
        for start_n in range(full_lo, full_end, BLOCK_N):
            dq = dq_tile(dq, q, do, lse2, delta, K, V, start_n + tl.arange(0, BLOCK_N), stride_kt, stride_kd,
                          stride_vt, stride_vd, cols, Tk, qk_scale, None, HEAD_DIM, DOT_PRECISION)
        for start_n in range(full_end, end, BLOCK_N):
            k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
            visible = _rule_visible(q_pos[:, None], k_pos[None, :], Tq, Tk, window_left, window_right, CAUSAL, WINDOW)
            dq = dq_tile(dq, q, do, lse2, delta, K, V, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols,
                          Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION)
    DQ = head_base(DQ, b, h, stride_dqb, stride_dqh)
    store_rows(DQ, dq * scale, q_pos, Tq, stride_dqt, cols, stride_dqd, HEAD_DIM)
