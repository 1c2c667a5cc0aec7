"""A consumer warpgroup's tile of scores in the Hopper forward (gluon_forward._softmax_rows): which tiles need the
mask and the mask itself (§6, §14), FlashAttention's softcap and ALiBi (§15), the online softmax step (§2, §8) and
the sink folded in after the last tile (§15). Gluon inlines each of these where it is called.

Imported only where Gluon exists (device.HAS_GLUON), as gluon_common.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .gluon_common import same_document, score_terms
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
def tile_terms(s, first_row, start_n, shift, qk_scale, softcap, slope, s_layout: gl.constexpr):
    """§15 softcap and ALiBi on the scores s (ROWS, N) of rows first_row ... and keys start_n ..., before the mask
    (score_terms; shift = Tk - Tq aligns the rows among the keys bottom-right, §6), in S's units."""
    rows = first_row + shift + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (ROWS,)
    keys = start_n + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout))  # (N,)
    return score_terms(s, rows[:, None], keys[None, :], qk_scale, softcap, slope)[0]

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
def softmax_step(s, m_i, l_i, qk_scale):
    """§2 the online softmax over one key tile's scores s (ROWS, N), as in tl_forward.fwd_tile: -> P, alpha
    (the factor for what the rows summed before), the running max and sum, in s's row layout as m_i and l_i are."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # §8 rows that have seen no key yet
    p = gl.exp2(s * qk_scale - m_ref[:, None])
    alpha = gl.exp2(m_i - m_ref)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)
