"""Variable-length attention: sequences of different lengths packed end to end along one dim, no padding (§14 of
docs/flash_attention.md).

    y = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)

The contract of FlashAttention's flash_attn_varlen_func, so code written for it switches with one import:
    q (total_q, Hq, D); k, v (total_k, Hkv, D), Hq a multiple of Hkv
    cu_seqlens_q, cu_seqlens_k (n + 1,) int32: sequence i is rows cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q and
        cu_seqlens_k[i]:cu_seqlens_k[i + 1] of k and v; both start at 0 and never decrease
    max_seqlen_q, max_seqlen_k: Python ints, the longest sequence of each (the GPU reads cu_seqlens itself, so a call
        never waits for the host to learn the lengths)
    causal: aligned bottom-right within each sequence, as attention()'s; window_size (left, right), -1 = unbounded
    dropout_p, softcap, alibi_slopes: as flash_attn_varlen_func's (dropout_p: attention()'s, §16) (alibi_slopes (Hq,) or (n, Hq), one row per sequence, the
        distance bottom-right aligned within each sequence); sinks, return_lse (keyword only): as attention()'s
    -> (total_q, Hq, Dv); with return_lse (out, lse), lse (Hq, total_q) float32 as flash_attn_varlen_func's
The triton backend runs every sequence in one launch; the other exact backends are references that attend sequence by
sequence (they read cu_seqlens on the host).
"""
import torch

from .inputs import check_matching, check_scale
from .masks import check_window
from .registry import attention, backend_terms, get_backend


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                     softmax_scale: float | None = None, causal: bool = False,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     alibi_slopes: torch.Tensor | None = None, *, backend: str = "triton",
                     sinks: torch.Tensor | None = None, return_lse: bool = False):
    """softmax(q k^T * softmax_scale) v within each packed sequence; see the module docstring."""
    spec = get_backend(backend)
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale)
    terms = backend_terms(backend, q, v, cu_seqlens_q.numel() - 1, softcap, alibi_slopes, sinks, return_lse,
                          batch_name="sequences", dropout_p=dropout_p)
    window = check_window(window_size)
    window = None if window == (-1, -1) else window
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    if spec.check_device is not None:
        spec.check_device(q.device)
    if spec.varlen is not None:
        return spec.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), causal, scale,
                           window, **terms)
    if not spec.exact:
        raise ValueError(f"backend {backend!r} computes another function than softmax attention and has no varlen "
                         "path; use backend='triton' (or an exact reference: sdpa, naive, compile)")
    return _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window, backend, **terms)


def _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window, backend, alibi_slopes=None,
                  return_lse=False, **terms):
    """The reference: attention() on each sequence, (1, H, T, D) at a time. terms: softcap, sinks."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    pieces, lse_pieces = [], []
    for i, ((q0, q1), (k0, k1)) in enumerate(zip(zip(starts_q, starts_q[1:]), zip(starts_k, starts_k[1:]))):
        if q1 == q0:
            continue
        if k1 == k0:  # no keys: every query sees none and gets 0 (and a zero gradient), as in every backend
            pieces.append(_zero_rows(q[q0:q1], v.shape[-1]))
            # the row's sum is the sink's term alone, or empty (lse +inf, as the kernels store it)
            sink, lse_dtype = terms.get("sinks"), torch.promote_types(q.dtype, torch.float32)
            lse_pieces.append(q.new_full((q.shape[1], q1 - q0), float("inf"), dtype=lse_dtype) if sink is None
                              else sink.detach().to(lse_dtype)[:, None].expand(-1, q1 - q0))
            continue
        seq_q, seq_k, seq_v = (t[a:b].transpose(0, 1).unsqueeze(0) for t, a, b in
                               ((q, q0, q1), (k, k0, k1), (v, k0, k1)))  # (1, H, T, D)
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[i]
        y = attention(seq_q, seq_k, seq_v, causal=causal, scale=scale, backend=backend, window=window,
                      alibi_slopes=slopes, return_lse=return_lse, **terms)
        if return_lse:
            y, lse = y
            lse_pieces.append(lse[0])  # (H, T)
        pieces.append(y[0].transpose(0, 1))  # (T, H, Dv)
    out = torch.cat(pieces) if pieces else _zero_rows(q, v.shape[-1])  # no queries at all
    if not return_lse:
        return out
    lse = (torch.cat(lse_pieces, dim=1) if lse_pieces
           else q.new_empty(q.shape[1], 0, dtype=torch.promote_types(q.dtype, torch.float32)))
    return out, lse


def _zero_rows(q_rows: torch.Tensor, value_dim: int) -> torch.Tensor:
    """(rows, H, value_dim) zeros that pass q's rows a zero gradient: the output of queries that see no key."""
    return (q_rows[..., :1] * 0).expand(*q_rows.shape[:-1], value_dim)


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                 softmax_scale=None) -> None:
    """The varlen contract's shapes, dtypes and devices, checked without reading a tensor on the GPU: on a CUDA
    device cu_seqlens' values are the caller's promise (reading them would make the host wait for the GPU)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, head_dim) as in flash_attn_varlen_func, got "
                             f"{shape}; pack (B, T, H, D) sequences with .reshape(B * T, H, D) or unpad them")
        if 0 in t.shape[1:]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: heads and head_dim must be at least 1")
    check_matching(q, k, v, value_head_dim=True)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not (isinstance(cu, torch.Tensor) and cu.dtype == torch.int32 and cu.dim() == 1 and cu.numel() >= 2):
            kind = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"{name} must be a 1-D int32 tensor of n + 1 >= 2 offsets (0, len0, len0 + len1, ...), "
                             f"got {kind}; build it with F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}; move it with .to(q.device)")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel() - 1} sequences but cu_seqlens_k has "
                         f"{cu_seqlens_k.numel() - 1}; they must describe the same sequences")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
            raise ValueError(f"{name} must be a Python int >= 0 (the longest sequence), got {n!r}; "
                             "compute it once per batch where the lengths are known, e.g. in the data loader")
    check_scale(softmax_scale, "softmax_scale")
    if q.device.type == "cpu" and not torch.compiler.is_compiling():  # no GPU to wait for: check the offsets
        for name, cu, total, longest in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                         ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
            lengths = cu.diff()
            if cu[0] != 0 or cu[-1] != total or (lengths < 0).any():
                raise ValueError(f"{name} must start at 0, never decrease and end at the {total} packed rows, got "
                                 f"{cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}")
            if lengths.max() > longest:
                raise ValueError(f"{name} holds a sequence of {int(lengths.max())} rows but max_seqlen is {longest}; "
                                 "pass the longest length")
