"""Mask helpers shared by the reference backends.

Causal attention with Tq != Tk is aligned bottom-right, as in FlashAttention-2: the last query
sits at the last key. That is what a block of new queries against a KV cache needs: query i
(0-based within the block) is at absolute position i + (Tk - Tq) and sees keys 0 .. i + Tk - Tq.
When Tq > Tk the first Tq - Tk queries see no key at all; every backend returns 0 for them.
"""
import torch


def causal_mask(Tq: int, Tk: int, device=None) -> torch.Tensor:
    """(Tq, Tk) bool, True where query i may attend to key j (bottom-right aligned)."""
    q_pos = torch.arange(Tq, device=device).unsqueeze(1) + (Tk - Tq)
    k_pos = torch.arange(Tk, device=device).unsqueeze(0)
    return k_pos <= q_pos
