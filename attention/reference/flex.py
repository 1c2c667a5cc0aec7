"""PyTorch's FlexAttention as the registry's "flex" backend, to compare our kernel with on the same masks:

    y = flex_attention_backend(q, k, v, causal, scale, mask=None)   # mask: an attention.BlockMask
    mask_mod = flex_mask_mod(causal=True, window=(256, 0), document_ids=ids, query_offset=Tk - Tq)

On CUDA flex_attention runs compiled into its fused kernels. Elsewhere it runs eagerly: PyTorch's reference
implementation, which materialises the scores, takes float64, and on CPU has no backward.
"""
import functools
import weakref
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ..block_mask import BlockMask

# our BlockMask -> its Flex block mask: a model passes one BlockMask to every layer of a step, so it is converted
# once; the weak key lets the entry go with the BlockMask (the Flex mask holds its rules, never the BlockMask)
_flex_masks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_causal_masks: dict[tuple, object] = {}  # (Tq, Tk, device) -> the Flex block mask of dense causal calls
FLEX_BLOCK = 128  # rows and columns of a Flex block (create_block_mask's default BLOCK_SIZE)


def flex_attention_backend(q, k, v, causal: bool, scale: float, mask: BlockMask | None = None, softcap: float = 0.0,
                           alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, Hq, Tq, D), k and v (B, Hkv, Tk, Dv) -> (B, Hq, Tq, Dv). mask: every rule of a sparse call, causal
    included; without it causal is aligned bottom-right (masks.py). A query that sees no key returns 0.
    softcap, alibi_slopes: attention()'s, through a score_mod (flex_score_mod)."""
    if q.device.type == "cpu" and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("backend 'flex' has no backward on CPU (PyTorch's FlexAttention computes "
                                  "gradients on CUDA only); train on CUDA, or with backend naive, sdpa or triton")
    Tq, Tk = q.shape[2], k.shape[2]
    if mask is not None:
        block_mask = _built_once(_flex_masks, mask, lambda: flex_block_mask(mask))
    elif causal:
        block_mask = _built_once(_causal_masks, (Tq, Tk, q.device), lambda: causal_block_mask(Tq, Tk, q.device))
    else:
        block_mask = None
    # Flex runs fewer queries than a block through its decoding kernel, which holds the queries of all the heads that
    # share a key head in one block and fails to compile when they overflow it: the main kernel takes any shape
    grouped_queries = Tq * (q.shape[1] // k.shape[1])
    kernel_options = {"FORCE_USE_FLEX_ATTENTION": True} if Tq < FLEX_BLOCK < grouped_queries else None
    run = compiled_flex() if q.device.type == "cuda" and not torch.compiler.is_compiling() else flex_attention
    score_mod = flex_score_mod(softcap, alibi_slopes, Tk - Tq) if softcap or alibi_slopes is not None else None
    return run(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True,
               kernel_options=kernel_options)


def flex_score_mod(softcap: float, alibi_slopes: torch.Tensor | None, query_offset: int) -> Callable:
    """attention()'s softcap (s -> softcap * tanh(s / softcap)) and then ALiBi bias (-slope * |q + query_offset - k|)
    as a Flex score_mod(score, b, h, q_idx, kv_idx), score being the scaled q.k."""
    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap:
            score = softcap * torch.tanh(score / softcap)
        if alibi_slopes is not None:
            slope = alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h]
            score = score - slope.to(score.dtype) * (q_idx + query_offset - kv_idx).abs().to(score.dtype)
        return score

    return score_mod


@functools.cache
def compiled_flex() -> Callable:
    """flex_attention compiled with static shapes, made on first use: a fixed-T training run compiles it once."""
    return torch.compile(flex_attention, dynamic=False)


def flex_mask_mod(*, causal: bool = False, window: tuple[int, int] | None = None,
                  document_ids: torch.Tensor | None = None, mask_fn: Callable | None = None,
                  query_offset: int = 0) -> Callable:
    """The AND of the rules of masks.py as a Flex mask_mod(b, h, q_idx, kv_idx) -> bool. query_offset: Tk - Tq, the
    queries being the last Tq of Tk positions. It is elementwise, so it is a masks.py mask_fn too."""
    left, right = window if window is not None else (-1, -1)

    def mask_mod(b, h, q_idx, kv_idx):
        position = q_idx + query_offset  # the query's absolute position
        visible = kv_idx <= position if causal else kv_idx.new_ones((), dtype=torch.bool)
        if left >= 0:
            visible = visible & (kv_idx >= position - left)
        if right >= 0:
            visible = visible & (kv_idx <= position + right)
        if document_ids is not None:
            visible = visible & (document_ids[b, position] == document_ids[b, kv_idx])
        if mask_fn is not None:
            visible = visible & mask_fn(b, h, q_idx, kv_idx)
        return visible

    return mask_mod


def flex_block_mask(mask: BlockMask):
    """Our BlockMask as a Flex block mask on its device, per batch row / head where ours varies along them."""
    Bm, Hm = mask.state.shape[:2]
    mask_mod = flex_mask_mod(causal=mask.causal, window=mask.window, document_ids=mask.document_ids,
                             mask_fn=mask.mask_fn, query_offset=mask.Tk - mask.Tq)
    return create_block_mask(mask_mod, B=Bm if Bm > 1 else None, H=Hm if Hm > 1 else None, Q_LEN=mask.Tq,
                             KV_LEN=mask.Tk, device=mask.state.device)


def causal_block_mask(Tq: int, Tk: int, device):
    """The Flex block mask of causal attention, aligned bottom-right, broadcast over batch and heads."""
    return create_block_mask(flex_mask_mod(causal=True, query_offset=Tk - Tq), B=None, H=None, Q_LEN=Tq, KV_LEN=Tk,
                             device=device)


def _built_once(cache, key, build: Callable):
    """cache[key], built on first use. Under torch.compile the build is traced into the caller's graph instead."""
    if torch.compiler.is_compiling():
        return build()
    if key not in cache:
        cache[key] = build()
    return cache[key]
