"""One call for every backend: attention(q, k, v, causal=True, scale=None, backend="sdpa", ...).

A backend is a function and what it can do (Backend): the model and the benchmarks treat every backend one way and
ask this table what a backend takes (masks, a packed qkv tensor, options of its own) instead of naming backends.
"""
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from .block_mask import BlockMask
from .reference.compiled import compiled_attention
from .inputs import TERMS, check_qkv, check_qkv_packed, check_terms, kept_per_tensor, unpack_qkv, used_terms
from .masks import check_document_ids, check_window
from .moba.reference import check_moba_options, moba_backend, moba_keys_per_query
from .reference.naive import naive_attention
from .reference.sdpa import sdpa_attention


@dataclass(frozen=True)
class Backend:
    """An attention implementation: fn(q, k, v, causal, scale, **extras) -> (B, Hq, Tq, D) on checked
    (B, Hq, Tq, D) / (B, Hkv, Tk, D) tensors, and what it takes besides."""
    fn: Callable
    supports_masks: bool = False  # takes mask=: a BlockMask holding the call's window / documents / block mask
    packed: bool = False  # takes qkv=: the (B, T, 3, nh, hs) tensor q, k, v are views of (attention_qkvpacked)
    options: Mapping[str, int] = field(default_factory=dict)  # keyword options of its own, with their defaults
    exact: bool = True  # softmax attention itself: exact backends differ from each other by rounding only
    kv_cache: bool = True  # takes fewer queries than keys (a KV cache); False: whole sequences only, Tq == Tk
    keys_per_query: Callable | None = None  # **options -> the most keys one query reads, where the backend bounds it
    check_options: Callable | None = None  # **options -> None, or a ValueError naming a bad value
    check_device: Callable | None = None  # device -> None, or a ValueError naming the backends that run there
    # attention_varlen (varlen.py) in one call: fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    # causal, scale, window, **terms); None: an exact backend runs it sequence by sequence
    varlen: Callable | None = None
    # the inputs.TERMS it computes: a call that uses one passes it to fn by name (softcap=, alibi_slopes=, sinks=,
    # dropout_p=, return_lse=True, then fn returns (out, lse)); "value_head_dim": v's head dim may differ from q's and
    # k's
    terms: frozenset = frozenset()


def _triton_attention(q, k, v, causal: bool, scale: float, mask: BlockMask | None = None, qkv=None, **terms):
    # Imported on first use: Triton decides at import time whether its kernels run compiled on the GPU or in the
    # CPU interpreter (TRITON_INTERPRET=1), so the user gets to set that first.
    from .flash.autograd import triton_attention

    return triton_attention(q, k, v, causal, scale, mask=mask, qkv=qkv, **terms)


def _cuda_attention(q, k, v, causal: bool, scale: float):
    # Imported on first use, as _triton_attention's: its first call builds the CUDA extension (cuda/build.py), and
    # nothing else in the project needs a compiler.
    from .cuda import cuda_attention

    return cuda_attention(q, k, v, causal, scale)


def _check_cuda_device(device: torch.device) -> None:
    from .cuda.build import check_cuda_device  # on first use, as _cuda_attention's import

    check_cuda_device(device)


def _triton_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, **terms):
    from .flash.autograd import triton_varlen_attention  # on first use, as _triton_attention's import

    return triton_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                                   window, **terms)


def _flex_attention(q, k, v, causal: bool, scale: float, mask: BlockMask | None = None, **terms):
    from .reference.flex import flex_attention_backend  # on first use, as _triton_attention's import

    return flex_attention_backend(q, k, v, causal, scale, mask=mask, **terms)


def _check_flex_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"FlexAttention computes gradients on a CUDA GPU only, and this runs on {device.type}; use "
                         "sdpa or naive there (or triton with TRITON_INTERPRET=1)")


def _check_triton_device(device: torch.device) -> None:
    from .flash.device import check_triton_device  # on first use, as _triton_attention's import

    check_triton_device(device)


def _with_dense_mask(fn: Callable) -> Callable:
    """A reference backend on a sparse call: it applies the BlockMask's element-level mask, (Tq, Tk)
    booleans per batch row/head, so it costs O(T^2) memory like the scores themselves."""
    def masked(q, k, v, causal: bool, scale: float, mask: BlockMask | None = None, **terms):
        if mask is None:
            return fn(q, k, v, causal=causal, scale=scale, **terms)
        return fn(q, k, v, causal=False, scale=scale, visible=mask.dense(q.shape[0], q.shape[1], q.device), **terms)
    return masked


ALL_TERMS = frozenset(TERMS)
_BACKENDS: dict[str, Backend] = {
    "naive": Backend(_with_dense_mask(naive_attention), supports_masks=True, terms=ALL_TERMS),
    "compile": Backend(_with_dense_mask(compiled_attention), supports_masks=True, terms=ALL_TERMS),
    "sdpa": Backend(_with_dense_mask(sdpa_attention), supports_masks=True,
                    terms=frozenset({"value_head_dim", "dropout_p"})),
    "triton": Backend(_triton_attention, supports_masks=True, packed=True, check_device=_check_triton_device,
                      varlen=_triton_varlen, terms=ALL_TERMS),
    # FlashAttention-2 in CUDA C++ (cuda/): fp16 / bf16, head dim 64 or 128, causal or not, GQA; no masks or terms
    "cuda": Backend(_cuda_attention, check_device=_check_cuda_device, terms=frozenset()),
    # PyTorch's FlexAttention (flex.py): the same masks through torch's compiled kernels, to compare ours with
    "flex": Backend(_flex_attention, supports_masks=True, check_device=_check_flex_device,
                    terms=frozenset({"softcap", "alibi_slopes", "value_head_dim"})),
    # MoBA (moba.py, §11): causal attention to the blocks each query selects; another function than the others
    "moba": Backend(moba_backend, options={"moba_block": 512, "moba_topk": 3}, exact=False, kv_cache=False,
                    keys_per_query=moba_keys_per_query, check_options=check_moba_options,
                    check_device=_check_triton_device),
}
def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def register_backend(name: str, fn: Callable, supports_masks: bool = False, **abilities) -> None:
    """Add a backend: fn(q, k, v, causal, scale) -> (B, Hq, Tq, D). With supports_masks it is also called as
    fn(q, k, v, causal, scale, mask=block_mask) for window / document / block-mask calls (mask: an
    attention.BlockMask that already holds the causal rule). abilities: Backend's other fields (packed, options,
    exact, kv_cache, keys_per_query, check_options, check_device, varlen, terms)."""
    if name in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is already registered")
    _BACKENDS[name] = Backend(fn, supports_masks, **abilities)


def get_backend(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of: {', '.join(available_backends())}"
        ) from None


def backend_options(name: str, **options) -> dict:
    """The backend's own options, its defaults filled in, or a ValueError naming the ones it takes."""
    spec = get_backend(name)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        takes = f"its options are {', '.join(spec.options)}" if spec.options else "it takes no options"
        raise ValueError(f"attention backend {name!r} got unknown option(s) {unknown}; {takes}")
    options = {**spec.options, **options}
    if spec.check_options is not None:
        spec.check_options(**options)
    return options


def keys_per_query(name: str, T: int, window: int = 0, **options) -> int:
    """The most keys one of T causal queries reads: T, window + 1 with a sliding window, or the backend's own bound
    (MoBA's selected blocks). Training's MFU credits a sparse model with this work, not the dense work it skips."""
    keys = T if not window else min(T, window + 1)
    options = backend_options(name, **options)
    bound = get_backend(name).keys_per_query
    return keys if bound is None else min(keys, bound(**options))


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
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    **options,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention softmax(q k^T * scale) v.

    q: (B, Hq, Tq, D); k, v: (B, Hkv, Tk, D) with Hq a multiple of Hkv (grouped-query attention); v may have a
        head dim of its own, (B, Hkv, Tk, Dv), and the output then has it.
    causal: query i sees keys up to i + Tk - Tq (bottom-right aligned; see masks.py).
    scale: defaults to 1/sqrt(D). Returns (B, Hq, Tq, Dv) in the dtype of q.
    Sparse attention (every rule given ANDs with the others; a query that sees no key returns 0):
    window: (left, right) in tokens, -1 = unbounded, e.g. (1024, 0) with causal for a sliding window.
    document_ids: (B, Tk) integer document id per position (packed sequences): no attention across
        documents. The queries are the last Tq positions.
    block_mask: an attention.BlockMask (from a mask function or a block layout), built once and
        reused across layers and calls.
    options: the backend's own (backend_options), e.g. backend="moba", moba_block=512, moba_topk=3.
    FlashAttention's terms (docs/flash_attention.md §15; naive, compile and triton compute them all):
    softcap: scores s = scale * q.k become softcap * tanh(s / softcap) (Gemma 2); 0 = off.
    alibi_slopes: float32 (Hq,) or (B, Hq): -slope * |i + Tk - Tq - j| is added to the scores (ALiBi).
    sinks: (Hq,) a learned logit per query head that joins each row's softmax denominator and weights no value
        (gpt-oss); it gets a gradient.
    return_lse: -> (out, lse), lse (B, Hq, Tq) float32 the natural log-sum-exp of each row's scores, the sink's
        included; +inf for a row that sees no key (and has no sink). Not differentiable.
    dropout_p: attention dropout (§16; naive, compile, sdpa and triton): each probability is dropped with this
        probability and the kept ones scaled by 1 / (1 - dropout_p), a new mask per call, reproducible under
        torch.manual_seed. Used as given: pass 0 in eval, as with sdpa's.
    """
    return _attention(q, k, v, causal, scale, backend, window, document_ids, block_mask, options,
                      terms=dict(softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse,
                                 dropout_p=dropout_p))


def attention_qkvpacked(
    qkv: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    backend: str = "sdpa",
    *,
    window: tuple[int, int] | None = None,
    document_ids: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    **options,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """attention() on q, k, v packed in one (B, T, 3, nh, hs) tensor: a fused qkv projection's (B, T, 3C)
    output viewed as .view(B, T, 3, nh, C // nh), the layout FlashAttention's qkvpacked functions take.
    Returns (B, nh, T, hs) like attention(). A backend that takes the packed tensor (triton) then returns the
    gradient of qkv as one tensor from its backward; given q, k, v as three views, autograd concatenates three
    gradients into it, a copy of qkv's size per call (the other backends still do that). softcap, alibi_slopes,
    sinks, return_lse, dropout_p: as attention()'s."""
    check_qkv_packed(qkv)
    q, k, v = unpack_qkv(qkv)
    return _attention(q, k, v, causal, scale, backend, window, document_ids, block_mask, options, qkv,
                      dict(softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse,
                           dropout_p=dropout_p))


def backend_terms(backend: str, q, v, batch: int, softcap=0.0, alibi_slopes=None, sinks=None, return_lse=False,
                  batch_name: str = "batch", dropout_p=0.0) -> dict:
    """The terms a call uses (inputs.TERMS), checked, as the keyword arguments the backend's function takes ({} for
    none), or a one-line error: a bad value, or a term the backend does not compute (naming those that do)."""
    if (softcap == 0.0 and alibi_slopes is None and sinks is None and not return_lse and v.shape[-1] == q.shape[-1]
            and type(dropout_p) in (int, float) and dropout_p == 0):
        return {}  # the common call, on every layer of a model: nothing to check (host time)
    check_terms(q, batch, q.shape[1], softcap, alibi_slopes, sinks, batch_name, dropout_p)
    used = used_terms(v.shape[-1], q.shape[-1], softcap, alibi_slopes, sinks, return_lse, dropout_p)
    missing = [name for name in used if name not in get_backend(backend).terms]
    if missing:
        able = [name for name, other in sorted(_BACKENDS.items()) if set(used) <= other.terms]
        raise ValueError(f"backend {backend!r} does not compute {', '.join(missing)}; use one of: {', '.join(able)}")
    given = dict(softcap=float(softcap), alibi_slopes=alibi_slopes, sinks=sinks, return_lse=True,
                 dropout_p=float(dropout_p))
    return {name: given[name] for name in used if name != "value_head_dim"}


def _attention(q, k, v, causal, scale, backend, window, document_ids, block_mask, options, qkv=None, terms=None):
    """attention(); qkv: the packed tensor q, k, v are views of, passed on to a backend that takes it. terms: the
    call's softcap, alibi_slopes, sinks, return_lse (backend_terms)."""
    spec = get_backend(backend)
    check_qkv(q, k, v, scale, value_head_dim=True)
    terms = backend_terms(backend, q, v, q.shape[0], **(terms or {}))
    extras = backend_options(backend, **options) if options or spec.options else {}
    if qkv is not None and spec.packed:
        extras["qkv"] = qkv
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if window in (None, (-1, -1)) and document_ids is None and block_mask is None:
        if causal and q.shape[2] == 1 and spec.kv_cache:
            # one query, aligned bottom-right, is the last position and sees every key: the causal mask
            # is all True. Dropping it lets KV-cache decoding take each backend's unmasked fast path
            # (sdpa would otherwise build a mask tensor per layer per token and fall back to a masked kernel).
            causal = False
        return spec.fn(q, k, v, causal=causal, scale=float(scale), **extras, **terms)
    if not spec.supports_masks:
        masked = [name for name, other in sorted(_BACKENDS.items()) if other.supports_masks]
        raise ValueError(f"backend {backend!r} does not support window / document_ids / block_mask; "
                         f"use one of: {', '.join(masked)}")
    mask = _sparse_mask(q, k, causal, window, document_ids, block_mask)
    return spec.fn(q, k, v, causal=mask.causal, scale=float(scale), mask=mask, **extras, **terms)


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
    if document_ids is not None and not torch.compiler.is_compiling():  # inside a graph the build is traced
        return _document_mask(Tq, Tk, causal, window, document_ids)
    return BlockMask.from_rules(Tq, Tk, causal=causal, window=window, document_ids=document_ids, device=q.device)


def _document_mask(Tq: int, Tk: int, causal: bool, window, document_ids: torch.Tensor) -> BlockMask:
    """BlockMask.from_rules for these document ids, built once for all the calls that pass the same ids tensor."""
    return kept_per_tensor(document_ids, ("mask", Tq, Tk, causal, window),
                           lambda: BlockMask.from_rules(Tq, Tk, causal=causal, window=window, document_ids=document_ids))
