"""Dense boolean masks: True where query i may attend to key j. The reference backends apply them
element by element; the flash kernels must skip exactly the pairs they mark False.

Causal attention with Tq != Tk is aligned bottom-right, as in FlashAttention-2: the last query
sits at the last key. That is what a block of new queries against a KV cache needs: query i
(0-based within the block) is at absolute position i + (Tk - Tq) and sees keys 0 .. i + Tk - Tq.
When Tq > Tk the first Tq - Tk queries see no key at all; every backend returns 0 for them.

The other rules use the same positions and AND together (dense_mask):
    window=(left, right)   key j visible iff pos - left <= j <= pos + right; -1 = unbounded that side
    document_ids (B, Tk)   one id per key position, the queries being the last Tq positions; a key is
                           visible only from its own document (packed sequences)
    mask_fn                any rule mask_fn(b, h, q_idx, kv_idx) -> bool on broadcasting index tensors
"""
from collections.abc import Callable

import torch


def _query_positions(Tq: int, Tk: int, device) -> torch.Tensor:
    """(Tq, 1) absolute position of each query: the queries are the last Tq of Tk positions."""
    return torch.arange(Tq, device=device).unsqueeze(1) + (Tk - Tq)


def causal_mask(Tq: int, Tk: int, device=None) -> torch.Tensor:
    """(Tq, Tk) bool, True where query i may attend to key j (bottom-right aligned)."""
    k_pos = torch.arange(Tk, device=device).unsqueeze(0)
    return k_pos <= _query_positions(Tq, Tk, device)


def check_window(window) -> tuple[int, int]:
    """(left, right) as two ints >= -1, or a ValueError that says how to write it."""
    if not (
        isinstance(window, (tuple, list))
        and len(window) == 2
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)
    ):
        raise ValueError(
            f"window must be two ints (left, right), each >= 0 or -1 for unbounded, got {window!r}; "
            "e.g. window=(1024, 0) with causal=True for a 1024-token sliding window"
        )
    return int(window[0]), int(window[1])


def window_mask(Tq: int, Tk: int, window, device=None) -> torch.Tensor:
    """(Tq, Tk) bool: key j within `left` positions before and `right` after the query's position."""
    left, right = check_window(window)
    offset = torch.arange(Tk, device=device).unsqueeze(0) - _query_positions(Tq, Tk, device)  # j - pos
    visible = torch.ones(Tq, Tk, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= offset >= -left
    if right >= 0:
        visible &= offset <= right
    return visible


def check_document_ids(document_ids, Tq: int, batch: int | None = None, Tk: int | None = None) -> None:
    """document_ids must be an integer (batch, Tk) tensor, one id per key position (None: any size)."""
    integer = isinstance(document_ids, torch.Tensor) and not (
        document_ids.dtype.is_floating_point or document_ids.dtype.is_complex or document_ids.dtype == torch.bool
    )
    if not integer:
        kind = document_ids.dtype if isinstance(document_ids, torch.Tensor) else type(document_ids).__name__
        raise TypeError(f"document_ids must be an integer tensor (e.g. torch.int32), got {kind}")
    shape = tuple(document_ids.shape)
    if len(shape) != 2 or (batch is not None and shape[0] != batch) or (Tk is not None and shape[1] != Tk):
        wanted = f"({batch}, {Tk})" if batch is not None and Tk is not None else "(batch, Tk)"
        raise ValueError(f"document_ids must have shape {wanted}, one id per key position, got {shape}")
    if Tq > shape[1]:
        raise ValueError(
            f"document_ids give the documents of the {shape[1]} key positions and the queries are the "
            f"last Tq of them, so Tq must be <= Tk; got Tq={Tq}"
        )


def document_mask(document_ids: torch.Tensor, Tq: int) -> torch.Tensor:
    """(B, 1, Tq, Tk) bool: a query sees only keys of its own document."""
    check_document_ids(document_ids, Tq)
    Tk = document_ids.shape[1]
    q_docs = document_ids[:, Tk - Tq:]  # (B, Tq): the queries are the last Tq positions
    return (q_docs[:, :, None] == document_ids[:, None, :]).unsqueeze(1)


def mask_fn_mask(mask_fn: Callable, B: int, H: int, Tq: int, Tk: int, device=None) -> torch.Tensor:
    """mask_fn evaluated on every (b, h, q_idx, kv_idx) at once: it gets index tensors b (B,1,1,1),
    h (1,H,1,1), q_idx (1,1,Tq,1), kv_idx (1,1,1,Tk), like FlexAttention's mask_mod but broadcasting
    instead of vmapped, and must return bool broadcastable to (B, H, Tq, Tk). Returned 4-D."""
    index = [torch.arange(n, device=device).view([n if d == dim else 1 for d in range(4)])
             for dim, n in enumerate((B, H, Tq, Tk))]
    visible = mask_fn(*index)
    if not isinstance(visible, torch.Tensor) or visible.dtype != torch.bool:
        kind = visible.dtype if isinstance(visible, torch.Tensor) else type(visible).__name__
        raise TypeError(
            f"mask_fn must return a bool tensor, got {kind}; build it from comparisons of its index "
            "arguments combined with & and |, e.g. lambda b, h, q_idx, kv_idx: q_idx >= kv_idx"
        )
    target = (B, H, Tq, Tk)
    if visible.dim() > 4 or any(n not in (1, t) for n, t in zip(visible.shape[::-1], target[::-1])):
        raise ValueError(
            f"mask_fn returned shape {tuple(visible.shape)}, which does not broadcast to (B, H, Tq, Tk) = "
            f"{target}; combine its index arguments elementwise without reducing or reshaping them"
        )
    return visible.view((1,) * (4 - visible.dim()) + tuple(visible.shape))


def dense_mask(Tq: int, Tk: int, *, causal: bool, window=None, document_ids: torch.Tensor | None = None,
               mask_fn: Callable | None = None, batch: int = 1, heads: int = 1, device=None) -> torch.Tensor:
    """The AND of every rule given, as bool broadcastable to (batch, heads, Tq, Tk): a dim is 1 where
    nothing varies along it (no document ids -> batch 1; no per-head mask_fn -> heads 1)."""
    if document_ids is not None:
        check_document_ids(document_ids, Tq, batch, Tk)
        wanted = torch.device(device) if device is not None else document_ids.device
        if wanted.type != document_ids.device.type or wanted.index not in (None, document_ids.device.index):
            raise ValueError(f"document_ids are on {document_ids.device} but the attention runs on {device}; "
                             "move them with .to(q.device)")
        device = document_ids.device
    if causal:
        visible = causal_mask(Tq, Tk, device=device)
    else:
        visible = torch.ones(Tq, Tk, dtype=torch.bool, device=device)
    if window is not None:
        visible = visible & window_mask(Tq, Tk, window, device=device)
    visible = visible[None, None]  # (1, 1, Tq, Tk)
    if document_ids is not None:
        visible = visible & document_mask(document_ids, Tq)  # (B, 1, Tq, Tk)
    if mask_fn is not None:
        visible = visible & mask_fn_mask(mask_fn, batch, heads, Tq, Tk, device=device)
    return visible
