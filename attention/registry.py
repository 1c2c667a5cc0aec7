"""One call for every backend: attention(q, k, v, causal=True, scale=None, backend="sdpa", ...)."""
from collections.abc import Callable

import torch

from .block_mask import BlockMask
from .compiled import compiled_attention
from .masks import check_document_ids, check_window
from .naive import naive_attention
from .sdpa import sdpa_attention
from .validate import check_qkv


def _triton_attention(q, k, v, causal: bool, scale: float, mask: BlockMask | None = None, qkv=None):
    # Imported on first use: Triton decides at import time whether its kernels run compiled on the
    # GPU or in the CPU interpreter (TRITON_INTERPRET=1), so the user gets to set that first.
    from .triton_op import triton_attention

    return triton_attention(q, k, v, causal, scale, mask=mask, qkv=qkv)


def _with_dense_mask(fn: Callable) -> Callable:
    """A reference backend on a sparse call: it applies the BlockMask's element-level mask, (Tq, Tk)
    booleans per batch row/head, so it costs O(T^2) memory like the scores themselves."""
    def masked(q, k, v, causal: bool, scale: float, mask: BlockMask | None = None):
        if mask is None:
            return fn(q, k, v, causal=causal, scale=scale)
        return fn(q, k, v, causal=False, scale=scale, visible=mask.dense(q.shape[0], q.shape[1], q.device))
    return masked


# name -> fn(q, k, v, causal, scale[, mask]) on validated (B, Hq, Tq, D) / (B, Hkv, Tk, D) tensors
_BACKENDS: dict[str, Callable] = {
    "naive": _with_dense_mask(naive_attention),
    "compile": _with_dense_mask(compiled_attention),
    "sdpa": _with_dense_mask(sdpa_attention),
    "triton": _triton_attention,
}
_SUPPORTS_MASKS = {"naive", "compile", "sdpa", "triton"}
# backends that also take qkv=, the packed tensor q, k, v are views of (attention_qkvpacked)
_TAKES_PACKED = {"triton"}
# (Tq, Tk, causal, window, device) -> BlockMask: a model passes the same window to every layer
_rule_masks: dict[tuple, BlockMask] = {}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def register_backend(name: str, fn: Callable, supports_masks: bool = False) -> None:
    """Add a backend: fn(q, k, v, causal, scale) -> (B, Hq, Tq, D). With supports_masks it is also
    called as fn(q, k, v, causal, scale, mask=block_mask) for window / document / block-mask calls
    (mask: an attention.BlockMask that already holds the causal rule)."""
    if name in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is already registered")
    _BACKENDS[name] = fn
    if supports_masks:
        _SUPPORTS_MASKS.add(name)


def get_backend(name: str) -> Callable:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of: {', '.join(available_backends())}"
        ) from None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    backend: str = "sdpa",
    *,
    window: tuple[int, int] | None = None,
    document_ids: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention softmax(q k^T * scale) v.

    q: (B, Hq, Tq, D); k, v: (B, Hkv, Tk, D) with Hq a multiple of Hkv (grouped-query attention).
    causal: query i sees keys up to i + Tk - Tq (bottom-right aligned; see masks.py).
    scale: defaults to 1/sqrt(D). Returns (B, Hq, Tq, D) in the dtype of q.
    Sparse attention (every rule given ANDs with the others; a query that sees no key returns 0):
    window: (left, right) in tokens, -1 = unbounded, e.g. (1024, 0) with causal for a sliding window.
    document_ids: (B, Tk) integer document id per position (packed sequences): no attention across
        documents. The queries are the last Tq positions.
    block_mask: an attention.BlockMask (from a mask function or a block layout), built once and
        reused across layers and calls.
    """
    return _attention(q, k, v, causal, scale, backend, window, document_ids, block_mask)


def unpack_qkv(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, 3, nh, hs) -> q, k, v (B, nh, T, hs), strided views of it (no copy)."""
    return tuple(t.transpose(1, 2) for t in qkv.unbind(2))


def attention_qkvpacked(
    qkv: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    backend: str = "sdpa",
    *,
    window: tuple[int, int] | None = None,
    document_ids: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
) -> torch.Tensor:
    """attention() on q, k, v packed in one (B, T, 3, nh, hs) tensor: a fused qkv projection's (B, T, 3C)
    output viewed as .view(B, T, 3, nh, C // nh), the layout FlashAttention's qkvpacked functions take.
    Returns (B, nh, T, hs) like attention(). The triton backend then returns the gradient of qkv as one
    tensor from its backward; given q, k, v as three views, autograd concatenates three gradients into it,
    a copy of qkv's size per call (the other backends still do that)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        shape = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        raise ValueError(f"qkv must be (batch, seq_len, 3, heads, head_dim), got {shape}; view a fused projection's "
                         "(B, T, 3 * C) output with .view(B, T, 3, n_head, C // n_head)")
    q, k, v = unpack_qkv(qkv)
    return _attention(q, k, v, causal, scale, backend, window, document_ids, block_mask,
                      qkv if backend in _TAKES_PACKED else None)


def _attention(q, k, v, causal, scale, backend, window, document_ids, block_mask, qkv=None):
    """attention(); qkv: the packed tensor q, k, v are views of, for a backend in _TAKES_PACKED."""
    fn = get_backend(backend)
    packed = {} if qkv is None else {"qkv": qkv}
    check_qkv(q, k, v, scale)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if window in (None, (-1, -1)) and document_ids is None and block_mask is None:
        if causal and q.shape[2] == 1:
            # one query, aligned bottom-right, is the last position and sees every key: the causal mask
            # is all True. Dropping it lets KV-cache decoding take each backend's unmasked fast path
            # (sdpa would otherwise build a mask tensor per layer per token and fall back to a masked kernel).
            causal = False
        return fn(q, k, v, causal=causal, scale=float(scale), **packed)
    if backend not in _SUPPORTS_MASKS:
        raise ValueError(f"backend {backend!r} does not support window / document_ids / block_mask; "
                         f"use one of: {', '.join(sorted(_SUPPORTS_MASKS))}")
    mask = _sparse_mask(q, k, causal, window, document_ids, block_mask)
    return fn(q, k, v, causal=mask.causal, scale=float(scale), mask=mask, **packed)


def _sparse_mask(q, k, causal, window, document_ids, block_mask) -> BlockMask:
    """The one BlockMask that holds every rule of the call, checked against the tensors."""
    (B, Hq, Tq, _), Tk = q.shape, k.shape[2]
    if window is not None:
        window = check_window(window)
    if document_ids is not None:
        check_document_ids(document_ids, Tq, B, Tk)
        if document_ids.device != q.device:
            raise ValueError(f"document_ids are on {document_ids.device} but q is on {q.device}; "
                             "move them with .to(q.device)")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be an attention.BlockMask, got {type(block_mask).__name__}; "
                            "build one with BlockMask.from_mask_fn(...) or BlockMask.from_layout(...)")
        Bm, Hm = block_mask.state.shape[:2]
        if (block_mask.Tq, block_mask.Tk) != (Tq, Tk) or Bm not in (1, B) or Hm not in (1, Hq):
            raise ValueError(
                f"block_mask was built for Tq={block_mask.Tq}, Tk={block_mask.Tk}, batch {Bm}, heads {Hm} but the "
                f"call has Tq={Tq}, Tk={Tk}, batch {B}, query heads {Hq}; build it for these sizes "
                "(batch/heads 1 broadcast)")
        if block_mask.state.device != q.device:
            raise ValueError(f"block_mask is on {block_mask.state.device} but q is on {q.device}; "
                             "build it with device=q.device")
        return block_mask.restrict(causal=causal, window=window, document_ids=document_ids)
    if document_ids is not None or torch.compiler.is_compiling():
        # document ids change with every batch; under torch.compile the build is traced into the graph
        return BlockMask.from_rules(Tq, Tk, causal=causal, window=window, document_ids=document_ids, device=q.device)
    key = (Tq, Tk, causal, window, q.device)
    if key not in _rule_masks:
        _rule_masks[key] = BlockMask.from_rules(Tq, Tk, causal=causal, window=window, device=q.device)
    return _rule_masks[key]
