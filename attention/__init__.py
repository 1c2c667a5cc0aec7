"""nanoflash attention: one call, swappable backends. Depends on torch and triton only.

    from attention import attention, Attention
    y = attention(q, k, v, causal=True, backend="triton")   # q, k, v: (B, nh, T, hs)
    y = Attention(backend="triton")(q, k, v)                # the same, as an nn.Module
    y = attention_qkvpacked(qkv, backend="triton")          # qkv: (B, T, 3, nh, hs), one gradient
"""
from .block_mask import BlockMask
from .masks import causal_mask
from .module import Attention
from .registry import attention, attention_qkvpacked, available_backends, get_backend, register_backend, unpack_qkv

__all__ = ["Attention", "BlockMask", "attention", "attention_qkvpacked", "available_backends", "causal_mask", "get_backend",
           "register_backend", "unpack_qkv"]
