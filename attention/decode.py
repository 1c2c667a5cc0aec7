"""Attention for one decoding step: one new query per sequence against a preallocated KV cache.

    y = decode_attention(q, k_cache, v_cache, cache_len, backend="triton")
    # q (B, Hq, 1, D); k_cache, v_cache (B, Hkv, max_len, D); cache_len (B,) int tensor on q's device

Unlike attention(q, k[:, :, :n], v[:, :, :n]), the number of valid keys n is a device tensor and
every call has the same shapes, so a decode step never reads a host int and can be captured in a
CUDA graph and replayed (GPT.generate does). See docs/decoding.md.
"""
import torch
import torch.nn.functional as F

from .registry import get_backend
from .inputs import check_qkv

CACHE_LEN_DTYPES = (torch.int32, torch.int64)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: torch.Tensor,
    scale: float | None = None,
    backend: str = "sdpa",
) -> torch.Tensor:
    """softmax(q k^T * scale) v over the first cache_len[b] keys of each sequence b.

    q: (B, Hq, 1, D), the newest token's queries; k_cache, v_cache: (B, Hkv, max_len, D) buffers,
    Hq a multiple of Hkv. cache_len: int32/int64 tensor of shape (B,), or () / (1,) for one length
    shared by all rows, on q's device: the valid cached positions, the new token's own key included
    (so 1..max_len; larger values count as max_len, and a row with 0 gets output 0 from naive and
    triton, as attention() defines a query that sees no key). Read on the device only.
    backend: "triton" runs the split-K kernel of flash/decode.py, which never loads the keys past
    cache_len; "naive" the explicit reference; every other backend (sdpa, compile, registered ones)
    F.scaled_dot_product_attention. These two read the whole buffer under a key mask and weight
    the masked values by exactly 0, so the buffer past cache_len must hold finite numbers (zeros,
    say), not uninitialised memory. Returns (B, Hq, 1, D) in q's dtype.
    """
    if not get_backend(backend).kv_cache:  # an unknown name gets the registry's error, listing the backends
        raise ValueError(f"backend {backend!r} attends whole sequences only and has no KV-cache decode step; "
                         "decode with a dense backend (sdpa, triton) or re-run the whole context")
    check_qkv(q, k_cache, v_cache, scale)
    _check_decode_inputs(q, k_cache, cache_len)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if backend == "triton":
        # imported on first use, as in registry.py: Triton reads TRITON_INTERPRET at import time
        from .flash.decode import decode
        from .flash.device import check_triton_support

        check_triton_support(q)
        return decode(q, k_cache, v_cache, cache_len, float(scale))
    return _masked_decode(q, k_cache, v_cache, cache_len, float(scale), explicit=backend == "naive")


def _check_decode_inputs(q: torch.Tensor, k_cache: torch.Tensor, cache_len) -> None:
    """What decode_attention adds to check_qkv: one query per sequence, and a device-side length."""
    B, Tq = q.shape[0], q.shape[2]
    if Tq != 1:
        raise ValueError(f"decode_attention takes one new query per sequence, q of shape (B, Hq, 1, D); got Tq={Tq}. "
                         "Run a prompt or a block of tokens through attention(q, k, v, causal=True) instead")
    if not isinstance(cache_len, torch.Tensor):
        raise TypeError(f"cache_len must be an integer tensor on q's device, got {type(cache_len).__name__}; "
                        f"use torch.tensor([n], device=q.device) (a host int would be frozen into a CUDA graph)")
    if cache_len.dtype not in CACHE_LEN_DTYPES:
        raise TypeError(f"cache_len must be int32 or int64, got {cache_len.dtype}; cast it with .long()")
    if cache_len.shape not in ((), (1,), (B,)):
        raise ValueError(f"cache_len must have shape ({B},), one length per sequence, or () / (1,) for all of "
                         f"them; got {tuple(cache_len.shape)}")
    if cache_len.device != q.device:
        raise ValueError(f"cache_len is on {cache_len.device} but q is on {q.device}; keep it on q's device, where "
                         "the step reads it without a host sync")


def _masked_decode(q, k_cache, v_cache, cache_len, scale: float, explicit: bool) -> torch.Tensor:
    B, Hq, _, D = q.shape
    Hkv, max_len = k_cache.shape[1], k_cache.shape[2]
    # The one query of each head attends to the same keys under the same mask as every other query
    # head of its group, so the group's queries become the rows of one (GROUP, D) query block per kv
    # head: GQA without repeating k and v, and no enable_gqa (which some SDPA kernels lack).
    q_rows = q.reshape(B, Hkv, Hq // Hkv, D)  # (B, Hkv, G, D)
    # (B or 1, 1, 1, max_len): static shape, the length enters only as data
    visible = (torch.arange(max_len, device=q.device) < cache_len.reshape(-1, 1))[:, None, None, :]
    if explicit:
        att = (q_rows @ k_cache.transpose(-2, -1)) * scale  # (B, Hkv, G, max_len)
        att = att.to(torch.promote_types(att.dtype, torch.float32))  # softmax in at least fp32, as naive.py
        att = torch.softmax(att.masked_fill(~visible, float("-inf")), dim=-1)
        att = att.masked_fill(~visible.any(dim=-1, keepdim=True), 0.0)  # no visible key: 0, not NaN
        y = att.to(v_cache.dtype) @ v_cache  # (B, Hkv, G, D)
    else:
        y = F.scaled_dot_product_attention(q_rows, k_cache, v_cache, attn_mask=visible, scale=scale)
    return y.reshape(B, Hq, 1, D)
