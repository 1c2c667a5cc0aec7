"""MoBA, Mixture of Block Attention (Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context
LLMs", arXiv:2502.13189): causal attention in which each query reads only a few blocks of keys.

The keys are cut into blocks of block_size positions. A query scores every block that lies wholly
in its past by q . mean(k over the block), keeps the topk best, and always adds its own block (under
the causal mask). It then attends to the keys of those topk + 1 blocks only, so the work per query is
at most (topk + 1) * block_size keys however long the sequence: linear in T instead of quadratic.
Like a mixture-of-experts router, the selection is a hard choice and is not differentiated; the
gradient flows through the attention over the chosen keys.

    selection = moba_select(q, k, block_size, topk)       # (B, Hq, T, topk + 1) block indices
    y = moba_attention(q, k, v, block_size=512, topk=3)   # the Triton kernel on the selection
    y = attention(q, k, v, backend="moba", moba_block=512, moba_topk=3)   # the same, as a registry backend
"""
import torch
import torch.nn.functional as F

from ..reference.compiled import compiled_attention
from ..masks import causal_mask
from ..reference.naive import naive_attention
from ..inputs import check_qkv

# Dense references of the same selection, for tests and for machines without the kernel
REFERENCE_BACKENDS = ("naive", "compile", "sdpa")


def check_moba_options(moba_block, moba_topk) -> None:
    if not (isinstance(moba_block, int) and not isinstance(moba_block, bool) and moba_block >= 16):
        raise ValueError(f"moba_block must be an int >= 16 (keys per MoBA block; the paper uses 512, the GPU kernel "
                         f"takes multiples of 128), got {moba_block!r}")
    if not (isinstance(moba_topk, int) and not isinstance(moba_topk, bool) and moba_topk >= 0):
        raise ValueError(f"moba_topk must be an int >= 0 (earlier blocks each query reads besides its own), "
                         f"got {moba_topk!r}")


def check_same_length(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"MoBA is training-time self-attention: q and k must have the same length, got Tq={q.shape[2]} and "
            f"Tk={k.shape[2]}; for decoding against a KV cache use dense attention(causal=True)"
        )


def block_means(k: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, Hkv, n_blocks, D) mean key of each block, summed in float32 (at least) without a float32
    copy of k; the last block may be shorter than block_size."""
    T = k.shape[2]
    dtype = torch.promote_types(k.dtype, torch.float32)
    whole = T // block_size * block_size
    sums = [k[:, :, :whole].unflatten(2, (-1, block_size)).sum(3, dtype=dtype)]  # (B, Hkv, T // bs, D)
    if whole < T:
        sums.append(k[:, :, whole:].sum(2, keepdim=True, dtype=dtype))
    counts = torch.full((-(-T // block_size), 1), block_size, dtype=dtype, device=k.device)
    counts[-1] = T - whole if whole < T else block_size
    return torch.cat(sums, 2) / counts


@torch.no_grad()  # a hard top-k choice: no gradient flows through the selection
def moba_select(q: torch.Tensor, k: torch.Tensor, block_size: int, topk: int) -> torch.Tensor:
    """(B, Hq, T, topk + 1) int64 key-block indices per query: slot 0 its own block, slots 1.. its
    topk past blocks (those ending at or before its block's start) by descending q . mean(k over the
    block), -1 in slots left empty (a query in block n has only n past blocks). Query head h reads kv
    head h // (Hq // Hkv). The last block may be shorter than block_size; its mean is over its keys."""
    check_qkv(q, k, k, None)
    check_moba_options(block_size, topk)
    check_same_length(q, k)
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    n_blocks = -(-T // block_size)
    means = block_means(k, block_size)  # (B, Hkv, n_blocks, D)
    # GQA without repeating: the G query heads of a kv head are one batch of rows for its means
    G = Hq // Hkv
    scores = q.to(means.dtype).reshape(B, Hkv, G * T, D) @ means.transpose(-2, -1)  # (B, Hkv, G*T, n_blocks)
    scores = scores.view(B, Hq, T, n_blocks)

    own = torch.arange(T, device=q.device) // block_size  # (T,) each query's block
    past = torch.arange(n_blocks, device=q.device)[None, :] < own[:, None]  # (T, n_blocks)
    scores = scores.masked_fill(~past, float("-inf"))
    # top-k by repeated argmax (k is a few, n_blocks tens): the procedure of the fused gate
    # (moba/tl_kernels.py:_moba_gate), so both pick the same blocks, ties going to the lower index
    chosen = []
    for _ in range(topk):
        best = scores.argmax(-1, keepdim=True)  # (B, Hq, T, 1)
        found = scores.gather(-1, best) > float("-inf")  # early queries run out of past blocks
        chosen.append(best.masked_fill(~found, -1))
        scores.scatter_(-1, best, float("-inf"))
    return torch.cat([own.expand(B, Hq, T)[..., None], *chosen], dim=-1)


def moba_mask(selection: torch.Tensor, block_size: int, Tk: int) -> torch.Tensor:
    """(B, Hq, Tq, Tk) bool: key j visible iff its block is in the query's selection and j <= query."""
    B, Hq, Tq, _ = selection.shape
    n_blocks = -(-Tk // block_size)
    # one row of n_blocks + 1 flags per query; the -1 slots land in the extra column, dropped after
    chosen = torch.zeros(B, Hq, Tq, n_blocks + 1, dtype=torch.bool, device=selection.device)
    chosen.scatter_(-1, selection.masked_fill(selection < 0, n_blocks), True)
    key_block = torch.arange(Tk, device=selection.device) // block_size  # (Tk,)
    return chosen[..., key_block] & causal_mask(Tq, Tk, device=selection.device)


def moba_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int = 512, topk: int = 3,
                   scale: float | None = None, backend: str = "triton") -> torch.Tensor:
    """MoBA attention on q (B, Hq, T, D), k, v (B, Hkv, T, D); returns (B, Hq, T, D).

    backend "triton": the block-sparse kernel reads only the selected blocks. "naive", "compile",
    "sdpa": the same selection applied as a dense (T, T) mask, O(T^2) memory: references for tests.
    """
    check_qkv(q, k, v, scale)
    check_moba_options(block_size, topk)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return moba_backend(q, k, v, True, scale, block_size, topk, backend)


def moba_backend(q, k, v, causal: bool, scale: float, moba_block: int = 512, moba_topk: int = 3,
                 backend: str = "triton") -> torch.Tensor:
    """The registry's "moba" backend (attention(..., backend="moba", moba_block=..., moba_topk=...)) on inputs
    check_qkv and check_moba_options passed: moba_attention with the registry's argument names."""
    if backend != "triton" and backend not in REFERENCE_BACKENDS:
        raise ValueError(f"moba_attention runs on backend 'triton' or a dense reference {REFERENCE_BACKENDS}, "
                         f"got {backend!r}")
    if not causal:
        raise ValueError("MoBA is causal attention (each query reads its own block under the causal mask and "
                         "earlier blocks); call it with causal=True")
    check_same_length(q, k)
    if backend == "triton":
        # imported on first use, as in registry.py: Triton fixes its interpreter mode at import
        from .tl_kernels import GATE_MAX_BLOCKS, moba_gate
        from .op import moba_triton
        from ..flash.device import check_triton_support

        check_triton_support(q)
        if -(-q.shape[2] // moba_block) > GATE_MAX_BLOCKS:  # very long sequences: the unfused router
            selection = moba_select(q, k, moba_block, moba_topk)
        else:
            selection = moba_gate(q, block_means(k, moba_block), moba_block, moba_topk)
        return moba_triton(q, k, v, selection, moba_block, scale)
    selection = moba_select(q, k, moba_block, moba_topk)
    visible = moba_mask(selection, moba_block, k.shape[2])
    if backend == "sdpa":
        # every query sees at least itself (its own block, causal), so no row is empty and needs zeroing
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    reference = naive_attention if backend == "naive" else compiled_attention
    return reference(q, k, v, causal=True, scale=scale, visible=visible)


def moba_keys_per_query(moba_block: int = 512, moba_topk: int = 3) -> int:
    """The most keys a MoBA query reads: its own block and moba_topk earlier ones (for MFU, model.py)."""
    return (moba_topk + 1) * moba_block
