"""nanoflash attention: one call, swappable backends. Depends on torch and triton only.

    from attention import attention, Attention
    y = attention(q, k, v, causal=True, backend="triton")   # q, k, v: (B, nh, T, hs)
    y = Attention(backend="triton")(q, k, v)                # the same, as an nn.Module
    y = attention_qkvpacked(qkv, backend="triton")          # qkv: (B, T, 3, nh, hs), one gradient
    y = attention(q, k, v, window=(256, 0))                 # sparse: sliding window, documents, block masks
    y = attention(q, k, v, backend="moba", moba_block=512, moba_topk=3)   # MoBA
    y = decode_attention(q, k_cache, v_cache, cache_len)   # one new token against a KV cache
    y = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)   # packed
"""
from .block_mask import BlockMask
from .decode import decode_attention
from .inputs import unpack_qkv
from .masks import causal_mask
from .module import Attention
from .registry import (Backend, attention, attention_qkvpacked, available_backends, backend_options, get_backend,
                       keys_per_query, register_backend)
from .varlen import attention_varlen

__all__ = ["Attention", "Backend", "BlockMask", "attention", "attention_qkvpacked", "attention_varlen", "available_backends",
           "backend_options", "causal_mask", "decode_attention", "get_backend", "keys_per_query", "register_backend",
           "unpack_qkv"]
