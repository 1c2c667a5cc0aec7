"""A consumer warpgroup's tile of scores in the Hopper forward (gluon_forward._softmax_rows): which tiles need the
mask and the mask itself (§6, §14), FlashAttention's softcap and ALiBi (§15), the online softmax step (§2, §8) and
the sink folded in after the last tile (§15); and the phases of a work item _softmax_rows runs through them: its
rows and their Q, the first key tile, the half tile at the diagonal, and the ring slots' waits and releases (§12).
Gluon inlines each of these where it is called.

Imported only where Gluon exists (device.HAS_GLUON), as gluon_common.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .gluon_common import document_span, same_document, score_terms
from .shapes import ROWS


@gluon.jit
def needs_mask(start_n, mask_from, every_from, BLOCK_N: gl.constexpr, DOCUMENTS: gl.constexpr):
    """Whether the key tile at start_n holds a key some row of the warpgroup does not see: one past mask_from
    (the first key not every row sees at the top, §6), or with DOCUMENTS one before every_from (the first key
    every row's document holds, §14)."""
    masked = start_n + BLOCK_N > mask_from
    if DOCUMENTS:
        masked = masked | (start_n < every_from)
    return masked

@gluon.jit
def mask_keys(s, first_row, start_n, diag, Tq, Tk, b, SPANS, IDS, stride_ids, s_layout: gl.constexpr):
    """s (ROWS, N) with -inf past each row's last visible key, min(row + diag, Tk - 1) (§6: diag = Tk - Tq
    under the causal mask; Tk otherwise, when only a ragged last tile's zero rows are hidden), and with SPANS
    (B, 2, Tq) (§14) outside each row's span (same_document)."""
    BLOCK_N: gl.constexpr = s.shape[1]
    rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (ROWS,)
    last_key = gl.minimum(rows + diag, Tk - 1)
    keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # (N,)
    visible = keys[None, :] <= last_key[:, None]
    if SPANS is not None:
        visible = visible & same_document(rows, keys, b, Tq, SPANS, IDS, stride_ids)
    return gl.where(visible, s, float("-inf"))

@gluon.jit
def key_positions(first, N: gl.constexpr, s_layout: gl.constexpr):
    """first + 0 ... N - 1 as float32 (N,) in the scores' column layout, for ALiBi's bias (§15), converted without
    a conversion per column: in a wgmma accumulator a thread's columns differ from one another by constants (bits 0
    and 3 and up of the column come from the register) and share bits 1-2 (its lane's), so first plus those bits is
    one value a thread, converted once, and the constants are the compiler's. A split of the column's bits, right
    for any layout; only its cost depends on the layout."""
    cols = gl.arange(0, N, layout=gl.SliceLayout(0, s_layout))  # (N,)
    return (first + (cols & 6)).to(gl.float32) + (cols & ~6).to(gl.float32)

@gluon.jit
def tile_terms(s, first_row, start_n, shift, cap_scale, slope, s_layout: gl.constexpr, FOLD: gl.constexpr):
    """§15 softcap and ALiBi on the scores s (ROWS, N) of rows first_row ... and keys start_n ..., before the mask
    (score_terms, in its units; shift = Tk - Tq aligns the rows among the keys bottom-right, §6). FOLD (ALiBi under
    the causal mask): the keys' part of the bias alone, past the origin first_row + shift, the first row's position;
    row first_row + i's scores then exceed its true ones by slope * i (alibi_rows)."""
    if FOLD:
        keys = key_positions(start_n - first_row - shift, s.shape[1], s_layout)  # (N,)
        s = score_terms(s, None, keys[None, :], cap_scale, slope)[0]
    else:
        rows = first_row + shift + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (ROWS,)
        keys = start_n + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout))  # (N,)
        s = score_terms(s, rows[:, None], keys[None, :], cap_scale, slope)[0]
    return s

@gluon.jit
def mirrored_terms(s, first_row, start_n, shift, unit, cap_scale, slope, s_layout: gl.constexpr):
    """§15 softcap and ALiBi folded on full attention (ALIBI_FULL) on the scores s (ROWS, N) of the key tile at start_n,
    by where its keys lie against the rows' positions o + i (o = first_row + shift, §6): left of every row, the bias's
    key part slope * (key - o) alone, as tile_terms' FOLD; right of every row, -slope * (key - o); across the rows, the
    whole bias -slope * |o + i - key|. Row i's scores then exceed its true ones by slope * i, -slope * i and 0.
    -> (s, the row shift in base 2 that brings them to the causal fold's slope * i, alibi_rows: 0, 2 and 1 times
    slope * unit * i), for softmax_step."""
    BLOCK_N: gl.constexpr = s.shape[1]
    o = first_row + shift
    i = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (ROWS,)
    keys = key_positions(start_n - o, BLOCK_N, s_layout)  # (N,) past o
    row_unit = (slope * unit) * i.to(gl.float32)
    left = start_n + BLOCK_N - 1 <= o
    if left | (start_n >= o + ROWS - 1):  # left or right of every row: one add per score
        s = score_terms(s, None, keys[None, :], cap_scale, gl.where(left, slope, -slope))[0]
        row_shift = row_unit * gl.where(left, 0.0, 2.0)
    else:  # the tiles across the rows' positions
        s = score_terms(s, i[:, None], keys[None, :], cap_scale, slope)[0]
        row_shift = row_unit
    return s, row_shift

@gluon.jit
def alibi_rows(slope, unit, rows_layout: gl.constexpr):
    """§15 ALiBi folded under the causal mask (tile_terms' FOLD): what the folded scores of a warpgroup's rows
    exceed their true ones by, in base 2 as m holds them: slope * unit * i for row first_row + i (ROWS,)."""
    return (slope * unit) * gl.arange(0, ROWS, layout=rows_layout).to(gl.float32)

@gluon.jit
def fold_sink(acc, l_i, m_i, sink):
    """§15 a sink of logit `sink` folded into the rows' finished online softmax (acc, l, m in base 2, §8), as one
    more key of score sink and value 0 after the last tile: -> acc, l and m rescaled to m' = max(m, sink * LOG2E),
    l' = l * exp2(m - m') + exp2(sink * LOG2E - m'). A row that saw no key gets l' = 1 (O = 0, lse = sink); a sink
    of -inf changes nothing (l' = 0 stays: O = 0, lse = +inf, §8)."""
    sink2 = sink * 1.4426950408889634
    m_new = gl.maximum(m_i, sink2)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # §8 no key and no sink: alpha 0, l stays 0
    alpha = gl.exp2(m_i - m_ref)
    return acc * alpha[:, None], l_i * alpha + gl.exp2(sink2 - m_ref), m_new

@gluon.jit
def softmax_step(s, m_i, l_i, unit, row_shift):
    """§2 the online softmax over one key tile's scores s (ROWS, N), as in tl_forward.fwd_tile: -> P, alpha
    (the factor for what the rows summed before), the running max and sum, in s's row layout as m_i and l_i are.
    unit: what turns s into base-2 logits (score_terms). row_shift: what to add to each row's scores in base 2 for
    m's frame (mirrored_terms), or None."""
    tile_max = gl.max(s, 1) * unit
    if row_shift is not None:
        tile_max = tile_max + row_shift
    m_new = gl.maximum(m_i, tile_max)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # §8 rows that have seen no key yet
    m_sub = m_ref
    if row_shift is not None:
        m_sub = m_ref - row_shift
    p = gl.exp2(s * unit - m_sub[:, None])
    alpha = gl.exp2(m_i - m_ref)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


# The phases of a consumer warpgroup's work item, in the order _softmax_rows takes them: each begins and ends where
# the code before the split already changed functions, so the sm_90 builds compile to the same SASS
# (docs/perf_notes.md section 12).

@triton.constexpr_function
def acc_layout(cols):
    """wgmma's accumulator layout for `cols` columns (S: BLOCK_N or half of it; O: HEAD_DIM): 4 warps stacked along
    the rows, instructions 16 rows by `cols` columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])

@gluon.jit
def wait_tile(ring, ready, t):
    """-> the slot of key tile number t (over the program's items) in its ring, once the tile is in."""
    SLOTS: gl.constexpr = ring.shape[0]
    slot = t % SLOTS
    mbarrier.wait(ready.index(slot), (t // SLOTS) & 1)
    return slot

@gluon.jit
def v_slot_of(v_smem, v_ready, t, k_slot, SPLIT: gl.constexpr):
    """-> V_t's slot, once V_t is in: with split rings its own, after a wait of its own; with one ring K_t's slot
    k_slot, whose wait counted V_t in too (gluon_forward._load_tiles)."""
    if SPLIT:
        return wait_tile(v_smem, v_ready, t)
    else:
        return k_slot

@gluon.jit
def k_done(k_empty, slot, SPLIT: gl.constexpr):
    """S of the K tile in `slot` is computed: with split rings the producer may refill its slot now (with one
    ring it waits for the V beside it, released after P V)."""
    if SPLIT:
        mbarrier.arrive(k_empty.index(slot), count=1)

@gluon.jit
def alibi_slope(SLOPES, bh, H, stride_slopes_b, stride_slopes_h, unit):
    """§15 the (batch, head)'s ALiBi slope in the scores' units (score_terms): slope * LOG2E / unit."""
    return gl.load(SLOPES + (bh // H) * stride_slopes_b + (bh % H) * stride_slopes_h).to(gl.float32) * (
        1.4426950408889634 / unit)

@gluon.jit
def item_rows(start_m, first_tile, item, bh, H, Tq, Tk, diag, SPANS, IDS, q_smem, q_ready, q_empty, ROW_SRC,
              WG: gl.constexpr, BLOCK_N: gl.constexpr, HALF_TILES: gl.constexpr, Q_IN_REGISTERS: gl.constexpr,
              q_operand: gl.constexpr):
    """Warpgroup WG's rows of work item `item` (first query row start_m, first key tile first_tile): where they
    start, the key tiles they see, and their Q once in. -> (first_row, mask_from, every_from, n_mine, n_full, q):
    the first key not every row sees (tiles reaching past it are masked), with SPANS the first key every row's
    document holds (§14; 0 without), the end of the rows' key tiles, the end of those taken whole (all but a last
    one of which no row sees past the first half, and not the first, where HALF_TILES), and Q: in registers
    (q_operand, its buffer released at once) or its tile in shared memory (released after the item's last S).
    One phase, not two (bounds, then Q): the edge between two helpers would fall between instructions of one
    function, and ptxas allocates the document builds otherwise (docs/perf_notes.md section 12)."""
    first_row = start_m + WG * ROWS
    # §6 the key tiles any of these rows sees (at least one: a row that sees no key still gets its 0 and
    # +inf from a fully masked tile), and the first key not every row sees: tiles reaching past it are masked.
    # Rows all past Tq (the last item of a head when 64 * CONSUMERS does not divide Tq: with three consumers
    # and Tq = 1024, two of them) store nothing: they take one tile and release the others unread.
    last_row = gl.minimum(first_row + ROWS, Tq) - 1
    last_key = gl.minimum(last_row + diag, Tk - 1)
    mask_from = gl.minimum(first_row + diag, Tk - 1) + 1
    # §14 documents: the first key every row's document holds (tiles before it are masked; all of them where
    # the ids are not runs) and the end of the first row's (tiles past it are masked)
    every_from = 0
    if SPANS is not None:
        every_from, last_end = document_span(SPANS, bh // H, last_row, Tq)
        if IDS is not None:
            every_from = gl.where(gl.load(SPANS + (bh // H).to(gl.int64) * 2 * Tq) == 0, every_from, Tk)
        last_key = gl.minimum(last_key, last_end - 1)
        _, first_end = document_span(SPANS, bh // H, gl.minimum(first_row, Tq - 1), Tq)
        mask_from = gl.minimum(mask_from, first_end)
    n_mine = gl.where(first_row < Tq, gl.maximum(gl.cdiv(last_key + 1, BLOCK_N), first_tile + 1),
                      first_tile + 1)
    last_seen = last_key - (n_mine - 1) * BLOCK_N  # in the last tile
    n_full = gl.where(HALF_TILES & (n_mine > first_tile + 1) & (last_seen < BLOCK_N // 2), n_mine - 1, n_mine)
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    CONSUMERS: gl.constexpr = q_smem.shape[0] // Q_BUFFERS
    buffer = item % Q_BUFFERS
    mbarrier.wait(q_ready.index(buffer), (item // Q_BUFFERS) & 1)
    if ROW_SRC is not None:  # gathered rows: the producer's copies, visible to the wgmma that reads them
        fence_async_shared()
    if Q_IN_REGISTERS:
        q = q_smem.index(buffer * CONSUMERS + WG).load(q_operand)  # (ROWS, D)
        # these reads are the generic proxy's, the copy engine's refill the async proxy's: without the
        # fence the next item's Q may land before they are done, and rows come out wrong (§12)
        fence_async_shared()
        mbarrier.arrive(q_empty.index(buffer), count=1)  # Q read: the next item's may load
    else:
        q = q_smem.index(buffer * CONSUMERS + WG)
    return first_row, mask_from, every_from, n_mine, n_full, q

@gluon.jit
def scored_tile(s, start_n, first_row, bh, H, mask_from, every_from, diag, Tq, Tk, cap_scale, slope, SPANS, IDS,
                stride_ids, FOLD: gl.constexpr):
    """The scores s (ROWS, N) of the key tile at start_n as the softmax takes them: §15 softcap and ALiBi first
    (tile_terms; FOLD its causal fold), then where some row does not see some key of the tile (needs_mask), the mask
    (mask_keys)."""
    BLOCK_N: gl.constexpr = s.shape[1]
    s_layout: gl.constexpr = acc_layout(BLOCK_N)
    if cap_scale is not None or slope is not None:
        s = tile_terms(s, first_row, start_n, Tk - Tq, cap_scale, slope, s_layout, FOLD)
    if needs_mask(start_n, mask_from, every_from, BLOCK_N, SPANS is not None):
        s = mask_keys(s, first_row, start_n, diag, Tq, Tk, bh // H, SPANS, IDS, stride_ids, s_layout)
    return s

@gluon.jit
def mirrored_tile(s, start_n, first_row, bh, H, mask_from, every_from, diag, Tq, Tk, unit, cap_scale, slope, SPANS,
                  IDS, stride_ids):
    """scored_tile with ALiBi folded on full attention (ALIBI_FULL): -> (the scores, their row shift), mirrored_terms."""
    BLOCK_N: gl.constexpr = s.shape[1]
    s_layout: gl.constexpr = acc_layout(BLOCK_N)
    s, row_shift = mirrored_terms(s, first_row, start_n, Tk - Tq, unit, cap_scale, slope, s_layout)
    if needs_mask(start_n, mask_from, every_from, BLOCK_N, SPANS is not None):
        s = mask_keys(s, first_row, start_n, diag, Tq, Tk, bh // H, SPANS, IDS, stride_ids, s_layout)
    return s, row_shift

@gluon.jit
def first_key_tile(q, k_smem, k_ready, k_empty, t, first_tile, first_row, bh, H, mask_from, every_from, diag, Tq, Tk,
                   unit, cap_scale, slope, SPANS, IDS, stride_ids, SPLIT: gl.constexpr, FOLD: gl.constexpr,
                   FULL: gl.constexpr):
    """The item's first key tile alone (its key tile first_tile, ring tile number t): S and its softmax, nothing
    to rescale yet. FULL: ALiBi folded on full attention (mirrored_tile). -> (its K slot, the running max, P, the
    running sum)."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    k_slot = wait_tile(k_smem, k_ready, t)
    s_token = warpgroup_mma(q, k_smem.index(k_slot).permute((1, 0)),
                            gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout(BLOCK_N)), use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_token])  # (ROWS, N)
    k_done(k_empty, k_slot, SPLIT)
    row_shift = None  # (as softmax_step takes it)
    if FULL:
        s, row_shift = mirrored_tile(s, first_tile * BLOCK_N, first_row, bh, H, mask_from, every_from, diag, Tq, Tk,
                                     unit, cap_scale, slope, SPANS, IDS, stride_ids)
    else:
        s = scored_tile(s, first_tile * BLOCK_N, first_row, bh, H, mask_from, every_from, diag, Tq, Tk, cap_scale,
                        slope, SPANS, IDS, stride_ids, FOLD)
    m_i = gl.max(s, 1) * unit  # §8 base-2 scores: the max commutes with the positive scale
    if row_shift is not None:
        m_i = m_i + row_shift
    m_sub = gl.where(m_i == float("-inf"), 0.0, m_i)
    if row_shift is not None:
        m_sub = m_sub - row_shift
    p = gl.exp2(s * unit - m_sub[:, None])
    return k_slot, m_i, p, gl.sum(p, 1)

@gluon.jit
def score_half_tile(t, j, k_slot, p, m_i, l_i, acc, q, k_smem, k_ready, k_empty, v_smem, v_ready, first_row, bh, H,
                    diag, Tq, Tk, unit, cap_scale, slope, SPANS, IDS, stride_ids, SPLIT: gl.constexpr,
                    FOLD: gl.constexpr, FULL: gl.constexpr):
    """A last key tile j (ring tile number t) taken by its first half, its second lying past every row's last key:
    S over the first half only (N/2 columns) issued together with P_{j-1} V_{j-1} (k_slot: K_{j-1}'s), always
    masked, in its own layout (acc_layout(N/2)), and its softmax while the P V may still run.
    -> (K_j's slot, V_{j-1}'s, the P V's token, P_j's half, alpha, the running max and sum in that layout)."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HALF_N: gl.constexpr = BLOCK_N // 2
    half_layout: gl.constexpr = acc_layout(HALF_N)
    half_rows: gl.constexpr = gl.SliceLayout(1, half_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout(k_smem.shape[2]), k_width=2)
    prev = k_slot
    k_slot = wait_tile(k_smem, k_ready, t)
    p_op = gl.convert_layout(p.to(k_smem.dtype), p_layout)
    k_half = k_smem.index(k_slot).slice(0, HALF_N)  # (N/2, D)
    half_token = warpgroup_mma(q, k_half.permute((1, 0)), gl.zeros([ROWS, HALF_N], gl.float32, half_layout),
                               use_acc=False, is_async=True)
    v_slot = v_slot_of(v_smem, v_ready, t - 1, prev, SPLIT)
    o_token = warpgroup_mma(p_op, v_smem.index(v_slot), acc, is_async=True)
    s_half = warpgroup_mma_wait(1, deps=[half_token])
    k_done(k_empty, k_slot, SPLIT)
    row_shift = None  # as in _softmax_rows: without ALiBi's full fold
    if FULL:
        s_half, row_shift = mirrored_terms(s_half, first_row, j * BLOCK_N, Tk - Tq, unit, cap_scale, slope,
                                           half_layout)
    elif cap_scale is not None or slope is not None:
        s_half = tile_terms(s_half, first_row, j * BLOCK_N, Tk - Tq, cap_scale, slope, half_layout, FOLD)
    s_half = mask_keys(s_half, first_row, j * BLOCK_N, diag, Tq, Tk, bh // H, SPANS, IDS, stride_ids, half_layout)
    p_half, alpha, m_half, l_half = softmax_step(s_half, gl.convert_layout(m_i, half_rows),
                                                 gl.convert_layout(l_i, half_rows), unit, row_shift)
    return k_slot, v_slot, o_token, p_half, alpha, m_half, l_half
