"""What the Gluon kernels of the forward (gluon_forward.py) and the backward (gluon_backward.py) share: Gluon's names
for the copies as Triton 3.6 and 3.9 spell them, the documents' spans (§14), a gathered problem's row copies (§11),
and the host-side tensor descriptors the copy engine reads by (§9).

Imported only where Gluon exists (device.HAS_GLUON): Gluon is experimental, its API moves between releases, and this
package is written for, and compiles with, Triton 3.6 and 3.9. Gluon has no CPU interpreter.
"""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .shapes import GATHER_WARPS

# Triton 3.9 renamed the TMA load and store, and cp.async's load; these names serve 3.6 and 3.9 alike
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
copy_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# gather_rows' copies: four threads per row, each 16 bytes of every 64 (sectors read whole), warps along the rows
GATHER_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [GATHER_WARPS, 1], [1, 0]))


@gluon.jit
def document_span(SPANS, b, row, T):
    """-> (first, end) of the span of `row` of batch entry b: the positions on the other side it sees, from first
    to one before end (§14 "Documents on the Hopper kernels"). SPANS (B, 2, T) int32. For documents: the first
    position of the row's document and the one past its last; first is -1 throughout a batch entry whose ids are
    not runs (an id that comes back after another), whose end is then T."""
    base = SPANS + b.to(gl.int64) * 2 * T
    return gl.load(base + row), gl.load(base + T + row)

@gluon.jit
def row_sources(ROW_SRC, first, n_rows, R: gl.constexpr):
    """The source rows of a gathered problem's rows first ... first + R - 1 (-1 for none, and past n_rows), in
    gather_rows' layout."""
    rows = first + gl.arange(0, R, layout=gl.SliceLayout(1, GATHER_LAYOUT))  # (R,)
    return gl.load(ROW_SRC + rows, mask=rows < n_rows, other=-1)

@gluon.jit
def key_block(b, h, t, ROW_SRC, KEY_HEADS, KEY_T):
    """The (b, h, t, 0) coordinate of a key tile that starts at key row t of head h of batch entry b. A gathered
    problem's keys (ROW_SRC, §11 "Keys read where they are") are one sequence, k's (B, KEY_HEADS, KEY_T) rows in that
    order, read where they lie: its row t is row t % KEY_T of head (t // KEY_T) % KEY_HEADS of batch entry
    t // (KEY_HEADS * KEY_T), whatever k's strides (the caller keeps a tile inside one head's rows)."""
    if ROW_SRC is not None:
        return t // (KEY_HEADS * KEY_T), (t // KEY_T) % KEY_HEADS, t % KEY_T, 0
    return b, h, t, 0

@gluon.jit
def gather_rows(src, H, T, smem, X, stride_xb, stride_xh, stride_xt, smem_2, X_2, stride_2b, stride_2h,
                stride_2t):
    """The producer's copy of a gathered problem's rows into smem (R, D) (§11 "MoBA on the Hopper kernels"): row i
    is row src[i] (row_sources) of X (B, H, T, D), numbered (b * H + h) * T + t, zeros where src is -1. With X_2
    (its own strides; None for none) the same rows of it into smem_2 (the backward's dO beside Q). The copy
    engine moves boxes of a tensor, not rows an index picks, so these are the producer's own asynchronous
    16-byte copies (cp.async), the whole tile at once from GATHER_WARPS warps; the caller's
    async_copy.mbarrier_arrive makes a barrier wait for them."""
    cols = gl.arange(0, smem.shape[1], layout=gl.SliceLayout(0, GATHER_LAYOUT))[None, :]  # (1, D)
    real = (src >= 0)[:, None]
    src = gl.maximum(src, 0)
    bh, t = src // T, (src % T).to(gl.int64)
    b, h = (bh // H).to(gl.int64), bh % H
    copy_load(smem, X + (b * stride_xb + h * stride_xh + t * stride_xt)[:, None] + cols, mask=real)
    if X_2 is not None:
        copy_load(smem_2, X_2 + (b * stride_2b + h * stride_2h + t * stride_2t)[:, None] + cols, mask=real)

@gluon.jit
def same_document(positions, others, b, T, SPANS, IDS, stride_ids):
    """§14 (P, O) whether position o (other side) lies in the span of position p of batch entry b (SPANS
    (B, 2, T), T positions on p's side), and where IDS is given and the entry's ids are not runs, whether both
    have the same id; never for positions past T. positions (P,) and others (O,) in the slices of one layout. The
    spans are read here, for the few masked tiles, so that nothing per row or key stays in registers over the
    loop; P is the side whose vectors cost fewer registers per thread. IDS None (spans that are intervals
    already, as MoBA's, §11) compiles the ids comparison out."""
    spans_b = SPANS + b.to(gl.int64) * 2 * T
    real = positions < T
    first = gl.load(spans_b + positions, mask=real, other=T)
    end = gl.load(spans_b + T + positions, mask=real, other=0)
    inside = (others[None, :] >= first[:, None]) & (others[None, :] < end[:, None])
    if IDS is not None:
        if gl.load(spans_b) != 0:  # not runs (first -1 throughout): compare ids
            ids_b = IDS + b.to(gl.int64) * stride_ids
            inside = inside & (gl.load(ids_b + positions, mask=real, other=0)[:, None]
                               == gl.load(ids_b + others, mask=others < T, other=0)[None, :])
    return inside


@functools.cache
def shared_layout(block: tuple, dtype: torch.dtype, swizzle: int | None = None) -> "gl.NVMMASharedLayout":
    """The shared-memory layout of a TMA block: swizzled in atoms of `swizzle` bytes, by default the widest the block
    allows. Made once per block: a Gluon layout's construction validates its fields, host time on every call."""
    if swizzle is None:
        element = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype]
        return gl.NVMMASharedLayout.get_default_for(list(block), element)
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=8 * dtype.itemsize, rank=len(block))


def descriptor(t: torch.Tensor, rows: int, swizzle: int | None = None) -> "TensorDescriptor":
    """A (B, H, T, D) tensor, any strides, read in (1, 1, rows, D) blocks, swizzled in atoms of `swizzle` bytes
    (default: the widest the block allows; the backward, §13, asks for narrower ones)."""
    block = (1, 1, rows, t.shape[-1])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), shared_layout(block, t.dtype, swizzle))


def document_args(documents: tuple[torch.Tensor, torch.Tensor] | None) -> tuple:
    """The kernels' SPANS, IDS, stride_ids for documents (spans, ids) (§14), or None, None, 0."""
    spans, ids = documents or (None, None)
    return spans, ids, 0 if ids is None else ids.stride(0)

@gluon.jit
def tanh_approx(x):
    """tanh(x) by PTX's tanh.approx.f32 (relative error under 2^-10.9, finite for every finite x, +-1 at +-inf): a
    softcap's tanh (§15) in one special-function instruction."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)

@gluon.jit
def score_terms(s, rows, keys, cap_scale, slope):
    """§15 FlashAttention's terms on a tile of scores s (the raw q.k products), in the units the softmax then takes
    them in: -> (s', t), s' times the kernel's unit (scale * LOG2E, or softcap * LOG2E with softcap) being
    LOG2E * (softcap * t + bias), the base-2 logit. Without softcap s' = s + bias / scale (t then s itself, unused);
    with it s' = t + bias / softcap, t = tanh(s * cap_scale), cap_scale = scale / softcap: the softmax's exp2 takes
    tanh's values as they come, where a factor back to S's units would cost a multiply per score.
    bias = -slope_h * |rows - keys|. rows, keys: the rows' positions among the keys (i + Tk - Tq) and the keys',
    shaped to broadcast over s. cap_scale: a float, or None without softcap; slope: the head's ALiBi slope in those
    units (slope * LOG2E / unit), or None. Entries a mask hides come out finite: the caller masks them after. tanh is
    the special-function unit's (tanh_approx), as tl_tiles.score_terms takes it on a GPU: one instruction beside the
    softmax's exp2 on the unit the forward is bound by (§12), where the exp2 and a division would take two.
    rows None: ALiBi folded under the causal mask (tl_tiles.score_terms' ALIBI_FOLD): keys are then the keys'
    positions past an origin o and the bias's key part alone is added, slope * (keys - o), one value per key; the row
    part, -slope * (row - o), is the caller's (the forward's m and lse, the backward's lse rows)."""
    t = s
    if cap_scale is not None:
        t = tanh_approx(s * cap_scale)
        s = t
    if slope is not None:
        if rows is None:  # the fold: small integers, exact in float, converted once per key
            s = s + slope * keys.to(gl.float32)
        else:  # positions converted as vectors, the distance in float: exact below 2^24, no per-score cast
            s = s - slope * gl.abs(rows.to(gl.float32) - keys.to(gl.float32))
    return s, t
