"""The readable reference: build the full (Tq, Tk) score matrix, mask, softmax, weight the values.

Memory is O(T^2) per head, which is exactly what the flash backends avoid; this is the backend
to read first and to check the others against.
"""
import torch

from ..masks import causal_mask


def naive_attention(q, k, v, causal: bool, scale: float, visible: torch.Tensor | None = None):
    """visible: bool broadcastable to (B, Hq, Tq, Tk), True where a query may see a key (masks.py builds
    it for windows, documents and mask functions); given, it replaces the causal mask, which it must
    then already include."""
    Hq, Tq, Tk = q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] != Hq:  # grouped-query attention: each k/v head serves Hq // Hkv query heads
        k = k.repeat_interleave(Hq // k.shape[1], dim=1)
        v = v.repeat_interleave(Hq // v.shape[1], dim=1)
    att = (q @ k.transpose(-2, -1)) * scale  # (B, nh, Tq, Tk)
    # softmax in at least fp32: in fp16/bf16 exp() of the row would lose most of its precision
    att = att.to(torch.promote_types(att.dtype, torch.float32))
    if visible is None and causal:
        visible = causal_mask(Tq, Tk, device=q.device)  # (Tq, Tk)
    if visible is not None:
        att = att.masked_fill(~visible, float("-inf"))
        att = torch.softmax(att, dim=-1)
        # a query with no visible key gets softmax(all -inf) = NaN; define it as 0. Its gradient stays
        # finite: the softmax backward is NaN on that row, but the -inf fill above passes no gradient
        # to masked entries, which in such a row are all of them.
        att = att.masked_fill(~visible.any(dim=-1, keepdim=True), 0.0)
    else:
        att = torch.softmax(att, dim=-1)
    return att.to(v.dtype) @ v  # (B, nh, Tq, Tk) x (B, nh, Tk, hs) -> (B, nh, Tq, hs)
