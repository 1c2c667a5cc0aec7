"""PyTorch's F.scaled_dot_product_attention, letting PyTorch pick its kernel (FlashAttention-2,
cuDNN, memory-efficient or math) for the device, dtype and shape."""
import torch.nn.functional as F

from ..masks import causal_mask


def sdpa_attention(q, k, v, causal: bool, scale: float, visible=None, dropout_p: float = 0.0):
    """visible: an explicit bool mask broadcastable to (B, Hq, Tq, Tk), used instead of `causal`. dropout_p: sdpa's
    (§16)."""
    Tq, Tk = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if visible is None:
        if not causal or Tq == Tk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa,
                                                  dropout_p=dropout_p)
        # is_causal=True aligns the mask top-left when Tq != Tk; we align bottom-right (see masks.py)
        visible = causal_mask(Tq, Tk, device=q.device)
    # a row with no visible key would be softmax over nothing (NaN, also in the backward pass): let
    # it see every key, then define its output as 0 like every other backend (so its gradients are 0)
    empty = ~visible.any(dim=-1, keepdim=True)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible | empty, scale=scale, enable_gqa=gqa,
                                       dropout_p=dropout_p)
    return y.masked_fill(empty, 0.0)
