"""What attention() takes: q, k, v checked before any backend runs, so bad input fails with a message that names
the fix instead of a shape error from deep inside a matmul or a kernel; q, k, v as views of one packed tensor; and
what is built from an input a model passes to every layer (document ids, cu_seqlens, a mask), kept per tensor."""
import weakref
from collections.abc import Callable

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale, value_head_dim: bool = False) -> None:
    """q: (B, Hq, Tq, D), k and v: (B, Hkv, Tk, D) with Hq a multiple of Hkv, every size at least 1.
    value_head_dim: v may have a head dim of its own, (B, Hkv, Tk, Dv) (the caller then checks the backend takes it)."""
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
    check_matching(q, k, v, value_head_dim)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q has batch size {q.shape[0]} but k/v have {k.shape[0]}")
    check_scale(scale)


def check_matching(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, value_head_dim: bool = False) -> None:
    """What q, k, v must agree on in every layout with heads at dim 1 and the head dim last ((B, H, T, D) for
    attention(), (total, H, D) for attention_varlen): a supported dtype and one of them, one device, k and v one
    shape (but for v's head dim, with value_head_dim), q and k one head dim, and query heads a multiple of key/value
    heads."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; use one of float16, bfloat16, float32, float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them with .to()")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same shape but for the head dim, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q has head_dim {q.shape[-1]} but k has {k.shape[-1]}; query and key head dims must match")
    if v.shape[-1] != k.shape[-1] and not value_head_dim:
        raise ValueError(f"v has head_dim {v.shape[-1]} but q and k have {k.shape[-1]}; a value head dim of its own "
                         "is taken by attention() and attention_varlen() only")
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


# The terms a call may add to softmax attention (attention(), attention_varlen()), named as FlashAttention names its
# arguments; a backend lists those it computes (registry.Backend.terms)
TERMS = ("softcap", "alibi_slopes", "sinks", "return_lse", "value_head_dim", "dropout_p")


def used_terms(v_head_dim: int, head_dim: int, softcap, alibi_slopes, sinks, return_lse,
               dropout_p=0.0) -> list[str]:
    """The TERMS a call uses, in TERMS' order."""
    used = dict(softcap=softcap != 0, alibi_slopes=alibi_slopes is not None, sinks=sinks is not None,
                return_lse=bool(return_lse), value_head_dim=v_head_dim != head_dim, dropout_p=dropout_p != 0)
    return [name for name in TERMS if used[name]]


def check_terms(q: torch.Tensor, batch: int, heads: int, softcap, alibi_slopes, sinks,
                batch_name: str = "batch", dropout_p=0.0) -> None:
    """softcap a number >= 0 (0: off); alibi_slopes float32 (heads,) or (batch, heads); sinks a floating (heads,)
    tensor; both on q's device; dropout_p a number in [0, 1). batch_name: what the batch dim is called
    (attention_varlen's is its sequences)."""
    if not (isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool) and 0 <= dropout_p < 1):
        raise ValueError(f"dropout_p must be a number in [0, 1) (0 = off; pass 0 in eval), got {dropout_p!r}")
    if not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and 0 <= softcap < float("inf")):
        raise ValueError(f"softcap must be a number >= 0 (0 = off; Gemma 2 uses 50.0 for attention), got {softcap!r}")
    for name, t, shapes in (("alibi_slopes", alibi_slopes, ((heads,), (batch, heads))), ("sinks", sinks, ((heads,),))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if tuple(t.shape) not in shapes:
            wanted = " or ".join(f"({heads},)" if len(s) == 1 else f"({batch}, {heads}) ({batch_name}, heads)"
                                 for s in shapes)
            raise ValueError(f"{name} must have shape {wanted}, one value per query head, got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move it with .to(q.device)")
    if alibi_slopes is not None and alibi_slopes.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"alibi_slopes must be float32 (as FlashAttention takes them), got {alibi_slopes.dtype}; "
                        "cast them with .float()")
    if sinks is not None and not sinks.dtype.is_floating_point:
        raise TypeError(f"sinks must be a floating tensor (one learned logit per query head), got {sinks.dtype}")


def sequence_spans(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(1, 2, total) int32 spans of packed sequences (§14): row t's sequence [first, end) from the (n + 1,) offsets,
    without reading them on the host. Kept per cu_seqlens tensor (as a model passes one to every layer)."""
    return kept_per_tensor(cu_seqlens, ("spans", total), lambda: _sequence_spans(cu_seqlens, total))


def _sequence_spans(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    rows = torch.arange(total, device=cu_seqlens.device, dtype=torch.int32)
    # the last offset at or before each row: empty sequences (repeated offsets) hold no row
    sequence = (torch.searchsorted(cu_seqlens, rows, right=True) - 1).clamp(max=cu_seqlens.shape[0] - 2)
    return torch.stack([cu_seqlens[sequence], cu_seqlens[sequence + 1]])[None].to(torch.int32)


# (id(tensor), key) -> (a weak reference to the tensor, its version, the value): what is built from a tensor that
# callers pass again and again (a batch's document ids or cu_seqlens, to every layer); the version (bumped by every
# in-place write) tells a tensor changed in place from the one the value was built from
_per_tensor: dict[tuple, tuple[weakref.ref, int, object]] = {}
KEPT_PER_TENSOR = 8


def kept_per_tensor(tensor: torch.Tensor, key: tuple, build: Callable):
    """build() once per (tensor, key) while the tensor is alive and unchanged; the last KEPT_PER_TENSOR kept."""
    if torch.compiler.is_compiling():  # inside a graph the build is traced, nothing kept
        return build()
    full_key = (id(tensor), *key)
    kept = _per_tensor.get(full_key)
    if kept is not None and kept[0]() is tensor and kept[1] == tensor._version:
        return kept[2]
    value = build()
    if len(_per_tensor) >= KEPT_PER_TENSOR:
        del _per_tensor[next(iter(_per_tensor))]  # the oldest: batches come and go
    _per_tensor[full_key] = (weakref.ref(tensor), tensor._version, value)
    return value
