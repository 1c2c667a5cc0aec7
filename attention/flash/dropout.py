"""Attention dropout's seeds and its debug path (docs/flash_attention.md §16).

Each call that drops probabilities draws a seed of its own (draw_seed) from torch's generator on q's device, so
torch.manual_seed reproduces a call's mask and the next call gets another. The kernels key Philox with that seed and
count the scores (tl_tiles.py: dropout_first, dropout_keep): the backward regenerates the forward's mask from the
seed alone, which the autograd context keeps; no mask is stored.

The debug path, for tests:

    with recording() as seeds:
        y = attention(q, k, v, backend="triton", dropout_p=0.1)
    keep = keep_mask(seeds[0], B, Hq, Tq, Tk, 0.1)   # (B, Hq, Tq, Tk) bool, the mask that call used
    keep = varlen_keep_mask(seeds[0], Hq, cu_seqlens_q, cu_seqlens_k, 0.1)  # a varlen call's (Hq, total_q, total_k)
"""
import contextlib

import torch

_recorded: list | None = None  # the seeds drawn inside recording(), else None


def draw_seed(device: torch.device) -> torch.Tensor:
    """A new seed, (1,) int64 on device, from torch's generator there: under torch.compile a random op of the graph,
    drawn anew at each run of it, not a constant baked into the graph."""
    seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=device)
    if _recorded is not None and not torch.compiler.is_compiling():
        _recorded.append(seed)
    return seed


@contextlib.contextmanager
def recording():
    """-> a list that collects the seed of every call drawn inside the block (eager calls), in call order."""
    global _recorded
    outer, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = outer


def keep_mask(seed: torch.Tensor, B: int, H: int, Tq: int, Tk: int, dropout_p: float) -> torch.Tensor:
    """(B, H, Tq, Tk) bool, True where a dense call of these sizes with this seed keeps a probability (§16), from the
    kernels' own counters (tl_tiles.py: dropout_mask)."""
    import triton

    from .tl_tiles import dropout_mask

    keep = torch.empty(B, H, Tq, Tk, dtype=torch.int8, device=seed.device)
    dropout_mask[(triton.cdiv(Tq, 16), B * H)](keep, seed, None, None, H, Tq, Tk, float(dropout_p), VARLEN=False,
                                               BLOCK_M=16, BLOCK_N=64)
    return keep.bool()


def varlen_keep_mask(seed: torch.Tensor, H: int, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     dropout_p: float) -> torch.Tensor:
    """(H, total_q, total_k) bool: a varlen call's keep mask, sequence i's block (rows cu_seqlens_q[i]:[i + 1],
    columns cu_seqlens_k[i]:[i + 1]) as the kernels draw it, False elsewhere. The kernels count each sequence's rows
    and keys from its own first, where its patches of scores (§16) start."""
    import triton

    from .tl_tiles import dropout_mask

    total_q, total_k = int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
    keep = torch.zeros(H, total_q, total_k, dtype=torch.int8, device=seed.device)
    longest = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    grid = (triton.cdiv(longest, 16), (len(cu_seqlens_q) - 1) * H)
    dropout_mask[grid](keep, seed, cu_seqlens_q.to(seed.device), cu_seqlens_k.to(seed.device), H, total_q, total_k,
                       float(dropout_p), VARLEN=True, BLOCK_M=16, BLOCK_N=64)
    return keep.bool()
