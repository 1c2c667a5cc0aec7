"""nanoflash attention: one call, swappable backends. Depends on torch and triton only.

    from attention import attention
    y = attention(q, k, v, causal=True, backend="triton")   # q, k, v: (B, nh, T, hs)
"""
from .masks import causal_mask
from .registry import attention, available_backends, get_backend, register_backend

__all__ = ["attention", "available_backends", "get_backend", "register_backend", "causal_mask"]
