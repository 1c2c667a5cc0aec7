"""FlashAttention-2 in Triton's `tl`: the pieces every `tl` kernel shares (docs/flash_attention.md, §N below).

  tl_forward.py   attn_fwd, a program per (query tile, batch*head): O and each row's log-sum-exp (§3, §4)
  tl_backward.py  attn_bwd_dq, then attn_bwd_dkdv (§5, §7)

Here: head and row addressing, loading and storing tiles with ragged edges, which keys a query sees (causal §6,
windows and documents §10, varlen §14) and which tiles a program walks. MoBA's kernels (moba/tl_kernels.py, §11) and
the decode kernel (flash/decode.py) reuse them.

Shape comments: M = BLOCK_M query rows, N = BLOCK_N key rows, D = BLOCK_D, the head dim padded to a power of two
(columns >= HEAD_DIM load as 0 and are never stored, so nothing is copied).
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) == exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # log(x) == log2(x) * LN2
# §15 the SOFTCAP switch's values, which tanh a softcap takes (device.softcap_tanh): 0 no softcap
SOFTCAP_EXP2 = tl.constexpr(1)  # from the exp2 and a division (the interpreter, GPUs before sm_75)
SOFTCAP_TANH_APPROX = tl.constexpr(2)  # the special-function unit's tanh.approx.f32
# §15 the ALIBI switch's values inside the kernels: 0 no ALiBi, True |row - key| per score, ALIBI_FOLD under the
# causal mask, where the row's part of the bias is a constant of the row, folded into m and lse (score_terms)
ALIBI_FOLD = tl.constexpr(2)


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
def head_rows(ptr, b, h, stride_b, stride_h, stride_t, n_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
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
def load_tile(src, start, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """The (len(rows), D) tile whose rows are start, start + 1, ...: from a descriptor (head_rows) or,
    for a pointer, as load_rows."""
    if isinstance(src, tl.tensor_descriptor):
        return src.load([start, 0])
    else:
        return load_rows(src, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM, CHECK_ROWS)


@triton.jit
def store_tile(dst, tile, start, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM: tl.constexpr):
    if isinstance(dst, tl.tensor_descriptor):
        dst.store([start, 0], tile.to(dst.dtype))  # rows past n_rows are not written
    else:
        store_rows(dst, tile, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM)


@triton.jit
def tile_visible(q_pos, k_pos, Tq, Tk, window_left, window_right, q_doc, k_doc, TILE_BITS, tile_id,
             CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, BITS: tl.constexpr,
             MASK_BLOCK: tl.constexpr):
    """True where query q_pos may attend to key k_pos (broadcast shapes, e.g. (M, 1) and (1, N)).
    Only tiles that need a mask call this: the AND of every rule the call uses (§6, §10). It runs on
    every score of a masked tile, so each rule costs as few integer ops per score as it can.
    Positions are bottom-right aligned: query i sits at absolute position i + Tk - Tq.
    q_doc, k_doc: the rows' document ids (load_document_ids), shaped like q_pos and k_pos; None without DOCS."""
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
def rule_visible(q_pos, k_pos, Tq, Tk, window_left, window_right, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """tile_visible for the kernels' dense path: the causal rule, a varlen call's window (§14), the end of the keys."""
    return tile_visible(q_pos, k_pos, Tq, Tk, window_left, window_right, None, None, None, -1, CAUSAL, WINDOW, False,
                    False, 16)


@triton.jit
def load_document_ids(DOC_IDS, pos, shift, n_rows, missing, DOCS: tl.constexpr):
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
def query_ranges(start_n, Tq, Tk, window_left, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
def sequence_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, b, Tq, Tk, VARLEN: tl.constexpr):
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
def rows_from(ptr, start, stride_t, VARLEN: tl.constexpr):
    """§14: ptr moved to row `start` of the packed rows (varlen); unchanged for a dense call."""
    if VARLEN:
        ptr += start.to(tl.int64) * stride_t
    return ptr


@triton.jit
def row_stats(STATS, b, h, H, n_rows, q_start, VARLEN: tl.constexpr):
    """Head h's first row in a per-row float32 statistic (the log-sum-exp, Delta): (B, H, n_rows) for a dense
    call; (H, n_rows) for varlen (§14), n_rows then the packed query rows, sequence b's from q_start."""
    if VARLEN:
        return STATS + h.to(tl.int64) * n_rows + q_start
    else:
        return STATS + (b * H + h).to(tl.int64) * n_rows


@triton.jit
def listed_row(BLOCKS, b, h, stride_b, stride_h, start, n_blocks, MASK_BLOCK: tl.constexpr, TILE: tl.constexpr):
    """§10: the block-mask row (see listed_tile) of the block holding position start, for batch row b and
    head h, and how many TILE-wide tiles its FULL blocks and all its listed blocks hold: -> row, n_full, n_listed."""
    row = BLOCKS + b * stride_b + h * stride_h + (start // MASK_BLOCK) * (2 + 2 * n_blocks)
    return row, tl.load(row) * (MASK_BLOCK // TILE), tl.load(row + 1) * (MASK_BLOCK // TILE)


@triton.jit
def listed_tile(row, i, MASK_BLOCK: tl.constexpr, TILE: tl.constexpr):
    """§10: the first position of the i-th tile of the blocks a block-mask row lists (row = [n_full,
    n_listed, blocks..., tile ids...], see attention/block_mask.py), counting TILE-wide tiles: each
    block holds MASK_BLOCK // TILE of them. One flat loop over tiles (not a loop per block) lets
    Triton's software pipelining prefetch across block boundaries."""
    TILES_PER_BLOCK: tl.constexpr = MASK_BLOCK // TILE
    return tl.load(row + 2 + i // TILES_PER_BLOCK) * MASK_BLOCK + (i % TILES_PER_BLOCK) * TILE


@triton.jit
def listed_tile_id(row, i, n_blocks, BITS: tl.constexpr, MASK_BLOCK: tl.constexpr, TILE: tl.constexpr):
    """The stored-mask tile id of the block holding listed tile i (-1 without a mask function)."""
    tile_id = -1
    if BITS:
        tile_id = tl.load(row + 2 + n_blocks + i // (MASK_BLOCK // TILE))
    return tile_id


# ---------------------------------------------------------------------------------------------
# FlashAttention's terms (§15): softcap, ALiBi, sinks; each a compile-time switch, so a call without it carries no code
# ---------------------------------------------------------------------------------------------
@triton.jit
def score_terms(qk, q_abs, k_pos, qk_scale, softcap, slope2, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """§15: one tile's scores with softcap and ALiBi, in base 2 (§8): -> (s2, t), s2 = LOG2E * (softcap * t + bias)
    with t = tanh(scale * qk / softcap) (s2 = qk * qk_scale + LOG2E * bias without softcap, and t then qk itself,
    unused), bias = -slope * |q_abs - k_pos|. qk: the raw q.k products; q_abs, k_pos: the rows' positions among the
    keys (i + Tk - Tq) and the keys', shaped to broadcast over qk ((M, 1) and (1, N), or transposed); slope2 = slope *
    LOG2E. The backward keeps t for softcap's derivative, 1 - t^2. Entries a mask hides come out finite: the caller
    masks them. SOFTCAP: 0 (False), SOFTCAP_EXP2 or SOFTCAP_TANH_APPROX (device.softcap_tanh).
    ALIBI == ALIBI_FOLD (the causal mask: every key a row sees has k_pos <= its position r): q_abs is then a scalar,
    the origin o, and the bias's key part alone is added, slope * (k_pos - o), one vector per tile; the row's part,
    -slope * (r - o), is the caller's (folded into m and lse once per row)."""
    t = qk  # a tensor either way: Triton returns no None inside a tuple
    if SOFTCAP == SOFTCAP_TANH_APPROX:  # x = qk * scale / softcap; ±1 at ±inf, so no score becomes NaN
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [qk * (qk_scale / (softcap * LOG2E))],
                                      dtype=tl.float32, is_pure=True, pack=1)
        s2 = t * (softcap * LOG2E)
    elif SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1), exp(2x) = exp2(2x LOG2E) with x = qk * scale / softcap: exact at both ends
        # (exp2 overflows to inf, t = 1; underflows to 0, t = -1), so no score becomes NaN
        t = 1.0 - 2.0 / (tl.exp2(qk * (2.0 * qk_scale / softcap)) + 1.0)
        s2 = t * (softcap * LOG2E)
    else:
        s2 = qk * qk_scale
    if ALIBI == ALIBI_FOLD:  # the keys' distances past the origin: small integers, exact in float, one per key
        s2 = s2 + slope2 * (k_pos - q_abs).to(tl.float32)
    elif ALIBI:  # positions converted as vectors, the distance in float: exact below 2^24, no per-score cast
        s2 = s2 - slope2 * tl.abs(q_abs.to(tl.float32) - k_pos.to(tl.float32))
    return s2, t


@triton.jit
def alibi_rows(slope2, n_rows: tl.constexpr):
    """§15 ALIBI_FOLD: the row part of the bias of n_rows rows whose first sits at the origin, slope2 * (r - o) for
    r - o = 0, 1, ...: what the rows' folded scores exceed their true ones by, and so their m (n_rows,)."""
    return slope2 * tl.arange(0, n_rows).to(tl.float32)


@triton.jit
def head_slope(SLOPES, b, h, stride_slopes_b, stride_slopes_h, ALIBI: tl.constexpr):
    """§15: this (batch row, head)'s ALiBi slope times LOG2E (stride_slopes_b 0 for slopes shared by the batch);
    None without ALIBI."""
    slope2 = None
    if ALIBI:
        slope2 = tl.load(SLOPES + b * stride_slopes_b + h * stride_slopes_h).to(tl.float32) * LOG2E
    return slope2


# ---------------------------------------------------------------------------------------------
# Forward (§2 online softmax, §3 tiling, §4 log-sum-exp)
# ---------------------------------------------------------------------------------------------
@triton.jit
def query_tile_start(BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """This program's first query row (§9 work order). Causal rows get longer down the sequence and
    the GPU starts programs in launch order, so the first programs take the last (longest) tiles:
    the short ones then fill the gaps at the end instead of a few long ones running on alone."""
    tile = tl.program_id(0)
    if CAUSAL:
        tile = tl.num_programs(0) - 1 - tile
    return tile * BLOCK_M


# ---------------------------------------------------------------------------------------------
# Dropout (§16): a keep mask regenerated from counters, never stored; a compile-time switch like §15's terms
# ---------------------------------------------------------------------------------------------
@triton.jit
def dropout_first(SEED, b, h, H, n_rows, q_start, VARLEN: tl.constexpr):
    """§16: -> (seed, row0), this program's Philox key (the call's seed, loaded once) and the row of head h's query 0
    as the log-sum-exp counts rows (row_stats: (b * H + h) * n_rows for a dense call, h * n_rows + q_start for
    varlen): dropout_keep's counters start from it."""
    seed = tl.load(SEED)
    if VARLEN:
        return seed, h.to(tl.int64) * n_rows + q_start
    return seed, (b * H + h).to(tl.int64) * n_rows


@triton.jit
def dropout_keep(seed, row0, rows, k_pos, n_cols, dropout_p):
    """§16: (M, N) True where score (rows, k_pos) is kept: rows (M, 1) a query tile's rows counted from row0, k_pos
    (N,) a key tile's columns (a sequence's own for varlen), each tile's first a multiple of 16. The scores come in
    patches of eight, rows {a, a + 8} by columns {c, c + 1, c + 8, c + 9} (a in the first half of its 16, c even
    there): the eight values one thread holds of a wgmma accumulator of S (queries by keys, the forwards), four of
    them where the tile is S^T (the Hopper backward). Patch (a, c) has the counter (row0 + a) * n_cols + c; one
    Philox draw of it (seven rounds, as FlashAttention-2's) gives four 32-bit words, word 2 * (row half) + (column
    half) for columns {c, c + 1} + 8 * (column half), its low 16 bits for the even column and its high 16 for the
    odd; a score is kept where its value is at or above dropout_p * 2^16: with probability 1 - dropout_p, to within
    2^-16."""
    M: tl.constexpr = rows.shape[0]
    N: tl.constexpr = k_pos.shape[0]
    i = tl.arange(0, M // 2)
    j = tl.arange(0, N // 4)
    a = tl.min(rows) + (i // 8) * 16 + i % 8  # (M / 2,) the patches' first rows
    c = tl.min(k_pos, 0) + (j // 4) * 16 + (j % 4) * 2  # (N / 4,) and first columns
    counters = (row0 + a.to(tl.int64))[:, None] * n_cols + c[None, :]  # (M / 2, N / 4)
    w0, w1, w2, w3 = tl.randint4x(seed, counters, 7)  # rows a, a + 8 by columns c, c + 8: 00, 01, 10, 11
    words = tl.join(tl.join(w0, w1), tl.join(w2, w3))  # (M / 2, N / 4, column half, row half)
    values = tl.join(words & 0xFFFF, words >> 16)  # (M / 2, N / 4, column half, row half, column parity)
    values = tl.reshape(values, (M // 16, 8, N // 16, 4, 2, 2, 2))
    # row = 16 * . + 8 * (row half) + ., column = 16 * . + 8 * (column half) + 2 * . + parity
    values = tl.reshape(tl.permute(values, (0, 5, 1, 2, 4, 3, 6)), (M, N))
    return values >= tl.cast(dropout_p * 65536.0, tl.uint32)


@triton.jit
def dropout_mask(KEEP, SEED, CU_SEQLENS_Q, CU_SEQLENS_K, H, n_rows, n_cols, dropout_p, VARLEN: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """§16 the debug path (flash/dropout.py): the keep mask a seed gives a dense call's (B, H, n_rows, n_cols)
    scores, or a varlen call's (H, total_q, total_k), each sequence's block of it (the rest untouched), by the
    kernels' own counters. A program per (row tile, batch entry * head), looping over the columns."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    q_start, k_start, seq_q, seq_k = sequence_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, b, n_rows, n_cols, VARLEN)
    seed, row0 = dropout_first(SEED, b, h, H, n_rows, q_start, VARLEN)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # (M, 1), the sequence's own
    if VARLEN:
        KEEP += (h.to(tl.int64) * n_rows + q_start) * n_cols + k_start
    else:
        KEEP += bh.to(tl.int64) * n_rows * n_cols
    for start_n in range(0, seq_k, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)  # (N,)
        keep = dropout_keep(seed, row0, rows, cols, n_cols, dropout_p)
        tl.store(KEEP + rows.to(tl.int64) * n_cols + cols[None, :], keep.to(tl.int8),
                 mask=(rows < seq_q) & (cols[None, :] < seq_k))

