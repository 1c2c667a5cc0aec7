"""PyTorch's F.scaled_dot_product_attention, letting PyTorch pick its kernel (FlashAttention-2,
cuDNN, memory-efficient or math) for the device, dtype and shape."""
import torch.nn.functional as F

from .masks import causal_mask


def sdpa_attention(q, k, v, causal: bool, scale: float):
    Tq, Tk = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if not causal or Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    # is_causal=True aligns the mask top-left when Tq != Tk; we align bottom-right (see masks.py)
    visible = causal_mask(Tq, Tk, device=q.device)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)
    if Tq > Tk:  # rows that see no key: define them as 0 like every other backend
        y = y.masked_fill(~visible.any(dim=-1)[:, None], 0.0)
    return y
