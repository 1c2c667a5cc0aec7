"""What attention() takes: q, k, v checked before any backend runs, so bad input fails with a message that names
the fix instead of a shape error from deep inside a matmul or a kernel; and q, k, v as views of one packed tensor."""
import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale) -> None:
    """q: (B, Hq, Tq, D), k and v: (B, Hkv, Tk, D) with Hq a multiple of Hkv, every size at least 1."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}; "
                "reshape (B, T, C) activations with .view(B, T, n_head, C // n_head).transpose(1, 2)"
            )
        if 0 in t.shape:
            dim = ("batch", "heads", "seq_len", "head_dim")[t.shape.index(0)]
            raise ValueError(f"{name} has {dim} 0 (shape {tuple(t.shape)}); attention needs at least one of each: "
                             f"check the {dim} of the tensors you pass (n_head and n_embd for heads and head_dim, "
                             "an empty batch or sequence upstream)")
    check_matching(q, k, v)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q has batch size {q.shape[0]} but k/v have {k.shape[0]}")
    check_scale(scale)


def check_matching(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What q, k, v must agree on in every layout with heads at dim 1 and the head dim last ((B, H, T, D) for
    attention(), (total, H, D) for attention_varlen): a supported dtype and one of them, one device, k and v one
    shape, one head dim, and query heads a multiple of key/value heads."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; use one of float16, bfloat16, float32, float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them with .to()")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q has head_dim {q.shape[-1]} but k/v have {k.shape[-1]}; query and key head dims must match")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"q has {q.shape[1]} heads and k/v have {k.shape[1]}: the number of query heads must be a multiple "
            "of the number of key/value heads (grouped-query attention)"
        )


def check_scale(scale, name: str = "scale") -> None:
    finite = isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale < float("inf")
    if scale is not None and not finite:
        raise ValueError(f"{name} must be a positive number or None (meaning 1/sqrt(head_dim)), got {scale!r}")


def unpack_qkv(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, 3, nh, hs) -> q, k, v (B, nh, T, hs), strided views of it (no copy)."""
    return tuple(t.transpose(1, 2) for t in qkv.unbind(2))


def check_qkv_packed(qkv) -> None:
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        shape = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        raise ValueError(f"qkv must be (batch, seq_len, 3, heads, head_dim), got {shape}; view a fused projection's "
                         "(B, T, 3 * C) output with .view(B, T, 3, n_head, C // n_head)")
