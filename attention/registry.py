"""One call for every backend: attention(q, k, v, causal=True, scale=None, backend="sdpa")."""
from typing import Callable

import torch

from .compiled import compiled_attention
from .naive import naive_attention
from .sdpa import sdpa_attention
from .validate import check_qkv


def _triton_attention(q, k, v, causal: bool, scale: float):
    # Imported on first use: Triton decides at import time whether its kernels run compiled on the
    # GPU or in the CPU interpreter (TRITON_INTERPRET=1), so the user gets to set that first.
    from .triton_op import triton_attention

    return triton_attention(q, k, v, causal, scale)


# name -> fn(q, k, v, causal, scale) on validated (B, Hq, Tq, D) / (B, Hkv, Tk, D) tensors
_BACKENDS: dict[str, Callable] = {
    "naive": naive_attention,
    "compile": compiled_attention,
    "sdpa": sdpa_attention,
    "triton": _triton_attention,
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def register_backend(name: str, fn: Callable) -> None:
    """Add a backend: fn(q, k, v, causal, scale) -> (B, Hq, Tq, D)."""
    if name in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is already registered")
    _BACKENDS[name] = fn


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
) -> torch.Tensor:
    """Scaled dot-product attention softmax(q k^T * scale) v.

    q: (B, Hq, Tq, D); k, v: (B, Hkv, Tk, D) with Hq a multiple of Hkv (grouped-query attention).
    causal: query i sees keys up to i + Tk - Tq (bottom-right aligned; see masks.py).
    scale: defaults to 1/sqrt(D). Returns (B, Hq, Tq, D) in the dtype of q.
    """
    fn = get_backend(backend)
    check_qkv(q, k, v, scale)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if causal and q.shape[2] == 1:
        # one query, aligned bottom-right, is the last position and sees every key: the causal mask
        # is all True. Dropping it lets KV-cache decoding take each backend's unmasked fast path
        # (sdpa would otherwise build a mask tensor per layer per token and fall back to a masked kernel).
        causal = False
    return fn(q, k, v, causal=causal, scale=float(scale))
