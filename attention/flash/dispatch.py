"""forward() and backward() of the `tl` and Hopper kernels: q (B, Hq, Tq, D), k and v (B, Hkv, Tk, D), any strides.

    o, lse = forward(q, k, v, causal, scale)            # mask: MaskArgs of a block-sparse call (§10), DENSE by default
    dq, dk, dv = backward(do, q, k, v, o, lse, causal, scale)
    o, lse = forward(q, k, v, causal, scale, mask, varlen)   # varlen (§14): q (total_q, Hq, D), k, v (total_k, Hkv, D)
    o, lse = forward(q, k, v, causal, scale, terms=Terms(softcap, alibi_slopes, sinks))   # §15; v may be (..., Dv)

Which kernels run: on Hopper the tuner (tuner.py, §9) times the `tl` forward (tl_forward.py) against the
warp-specialized one (hopper/gluon_forward.py, §12), and the two `tl` backward kernels (tl_backward.py) against the
warp-specialized backward (hopper/gluon_backward.py, §13), and keeps the faster per shape; elsewhere the `tl` kernels
run. FlashAttention's terms softcap, ALiBi and sinks (§15) run on both, compiled into the Hopper kernels where a dense
call (or documents) has them (hopper_call), and so does dropout (§16); a value head dim of its own and varlen calls
with a term keep to the `tl` kernels.
NANOFLASH_HOPPER: "auto" (time them), "1" (take the Hopper kernels wherever they can run), "0" (never).
NANOFLASH_TMA=1: the `tl` forward may also load its tiles through tensor descriptors (§9), timed beside pointer loads.

Launch plans. A dense call launches the same way as another of the same shapes, strides, dtypes, 16-byte alignment
and device, with the settings in plan_key: its plan key. The first call of a key takes the whole path (the kernels'
eligibility checks, the tuner, launch.py's keys over every argument) and leaves a plan, again(the call's tensors,
scale): its launches with everything else worked out. Later calls of the key run the plan: at small shapes the whole
path costs more host time than the kernels take on the GPU (docs/perf_notes.md, "Host time").
"""
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

from . import native
from .hopper import backward as hopper_backward
from .hopper import forward as hopper_forward
from .hopper.shapes import FORWARD_TILES, document_tiles, term_tiles
from .launch import planned, remember
from .tl_backward import attn_bwd_dkdv, attn_bwd_dq
from .tl_forward import attn_fwd
from .device import INTERPRET, has_tma
from .terms import (NO_TERMS, Terms, hopper_call, plain_call, sink_grad, term_args, term_constants, term_values,
                    with_values)
from .tuner import backward_choice, tuned_launch, use_scratch_allocator

TMA_MODE = os.environ.get("NANOFLASH_TMA", "0")
HOPPER_MODE = os.environ.get("NANOFLASH_HOPPER", "auto")


def empty_bthd(B: int, H: int, T: int, D: int, like: torch.Tensor) -> torch.Tensor:
    """Uninitialised (B, H, T, D) stored as (B, T, H, D): the model's y.transpose(1, 2) of it is
    contiguous, so merging the heads back into (B, T, C) costs no copy (and likewise for grads). One torch call, not
    an empty and a transpose: an eager backward allocates three of these, and each torch call is host time."""
    return torch.empty_strided((B, H, T, D), (T * H * D, D, H * D, 1), dtype=like.dtype, device=like.device)


def _constants(q: torch.Tensor, causal: bool, mask: "MaskArgs", varlen: "Varlen | None") -> dict:
    D = q.shape[-1]
    return dict(
        HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D),
        CAUSAL=causal,
        # §8: fp32 inputs get exact fp32 products; TF32 would add ~1e-3 relative error. fp16 and
        # bf16 dots are exact products with fp32 sums either way ("tf32" is Triton's default).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SPARSE=mask.kv_blocks is not None,
        WINDOW=mask.window is not None,
        DOCS=mask.document_ids is not None,
        BITS=mask.tile_bits is not None,
        MASK_BLOCK=mask.block_size,
        VARLEN=varlen is not None,
    )


def use_tma(*tensors: torch.Tensor) -> bool:
    """§9: with NANOFLASH_TMA=1, the forward may load tiles through tensor descriptors (TMA) where the
    GPU has the copy engine (Hopper and newer; the interpreter runs them too, for the CPU tests) and
    every tensor fits its rules: unit stride along the head dim, every other stride and the start
    16-byte aligned. Other layouts take the pointer loads, which read any strides."""
    if TMA_MODE != "1" or not (INTERPRET or has_tma(tensors[0].device)):
        return False
    return hopper_forward.tma_can_read(*tensors)


class MaskArgs(NamedTuple):
    """A block-sparse call's mask as plain tensors and numbers (§10); all None for dense attention.
    attention/block_mask.py builds them; the PyTorch op (flash/autograd.py) passes them through."""
    kv_blocks: torch.Tensor | None = None  # (Bm, Hm, n_q_blocks, 2 + 2 n_kv_blocks) int32, forward and dQ
    q_blocks: torch.Tensor | None = None  # (Bm, Hm, n_kv_blocks, 2 + 2 n_q_blocks) int32, dK/dV
    window: tuple[int, int] | None = None  # (left, right), -1 = unbounded
    document_ids: torch.Tensor | None = None  # (B, Tk) integer
    tile_bits: torch.Tensor | None = None  # (n_tiles, block, block) uint8
    block_size: int = 16  # unused when dense
    # (B, 2, T) int32, each position's document [first, end) (§14): where the Hopper kernels may keep attention
    # inside documents themselves (documents alone, Tq == Tk, on an sm_90 GPU); None elsewhere
    spans: torch.Tensor | None = None


DENSE = MaskArgs()


def _hopper_takes(terms: Terms, q: torch.Tensor, v: torch.Tensor, varlen: "Varlen | None",
                  documents: tuple | None) -> bool:
    """Whether the call's terms let it on the Hopper kernels: a dense call (hopper_call), or documents without terms
    (varlen ones as one batch entry: their slopes would be per sequence, §15; autograd keeps spans to plain calls)."""
    if varlen is None:
        return hopper_call(terms, q, v)
    return documents is not None and plain_call(terms, q, v)


class Varlen(NamedTuple):
    """§14: a varlen call's sequences, packed end to end along the rows: sequence i is rows
    cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q and cu_seqlens_k[i]:cu_seqlens_k[i + 1] of k and v."""
    cu_seqlens_q: torch.Tensor  # (n + 1,) int32, from 0 up to total_q
    cu_seqlens_k: torch.Tensor  # (n + 1,) int32, from 0 up to total_k
    max_seqlen_q: int  # the longest sequences: the grid covers them, shorter ones leave programs idle
    max_seqlen_k: int


def _strides(t: torch.Tensor, varlen: Varlen | None) -> tuple:
    """t's (batch, head, row, dim) strides as the kernels take them: a varlen call's (total, H, D) rows are one
    batch entry per sequence, found through cu_seqlens, so its batch stride is 0 (§14)."""
    return t.stride() if varlen is None else (0, t.stride(1), t.stride(0), t.stride(2))


def _rows(t: torch.Tensor, varlen: Varlen | None) -> int:
    """The kernels' Tq or Tk argument: a dense call's sequence length, a varlen call's packed rows."""
    return t.shape[2] if varlen is None else t.shape[0]


def _sizes(q: torch.Tensor, k: torch.Tensor, varlen: Varlen | None) -> tuple[int, int, int]:
    """-> (batch entries, Tq, Tk) the grid and the tuner see: a varlen call's sequences and longest lengths."""
    if varlen is None:
        return q.shape[0], q.shape[2], k.shape[2]
    return varlen.cu_seqlens_q.shape[0] - 1, varlen.max_seqlen_q, varlen.max_seqlen_k


def _cu_seqlens(varlen: Varlen | None) -> tuple:
    """A varlen call's cu_seqlens, which its plan takes anew with every call; () for a dense call."""
    return () if varlen is None else (varlen.cu_seqlens_q, varlen.cu_seqlens_k)


def _sequence_args(varlen: Varlen | None) -> tuple:
    """The kernels' CU_SEQLENS_Q, CU_SEQLENS_K arguments."""
    return _cu_seqlens(varlen) or (None, None)


def _tiles_divide(mask: MaskArgs) -> int | None:
    return mask.block_size if mask.kv_blocks is not None else None  # a sparse call's tiles walk its blocks


def _block_list_args(mask: MaskArgs, lists: torch.Tensor | None, Tq: int, Tk: int) -> tuple:
    """The kernels' mask arguments (BLOCKS ... TILE_BITS) for one block list (kv or q direction)."""
    left, right = mask.window or (-1, -1)
    unbounded = Tq + Tk  # -1: farther than any key can be from any query
    window = (unbounded if left < 0 else left, unbounded if right < 0 else right)
    if lists is None:  # dense, or a varlen call's window (§14)
        return (None, 0, 0, 0, *window, None, 0, None)
    Bm, Hm, rows, row_len = lists.shape
    # size-1 (broadcast) batch/head dims of the mask get stride 0: every batch row / head reads the same lists
    stride_b = Hm * rows * row_len if Bm > 1 else 0
    stride_h = rows * row_len if Hm > 1 else 0
    docs = mask.document_ids
    return (lists, stride_b, stride_h, (row_len - 2) // 2, *window, docs,
            docs.stride(0) if docs is not None else 0, mask.tile_bits)


# plan key -> again(the call's tensors, scale): the launch plans of the module docstring
_plans: dict[tuple, Callable] = {}


def forget_plans() -> None:
    """Drop every launch plan, so the next call of each key takes the whole path again (after a change to a setting
    the plans bind, such as a tile list), and the native extension's passes of them (native.py)."""
    _plans.clear()
    native.forget()


def _plan_key(kind: str, causal: bool, mask: MaskArgs, varlen: Varlen | None, *tensors: torch.Tensor,
              terms: Terms = NO_TERMS) -> tuple | None:
    """-> the call's plan key; None for a block-sparse call (§10), whose mask tensors change from call to call.
    A varlen call's cu_seqlens are among its tensors (its plan takes them anew), its longest lengths in the key.
    §15: which terms are on, and their tensors' layouts and alignment (softcap's value is an argument: the plan takes
    it anew)."""
    if any(t is not None for t in (mask.kv_blocks, mask.q_blocks, mask.document_ids, mask.tile_bits, mask.spans)):
        return None
    on = None if terms is NO_TERMS else (bool(terms.softcap), bool(terms.dropout_p),
                                         *[None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0)
                                           for t in (terms.alibi_slopes, terms.sinks, terms.dropout_seed)])
    return (kind, causal, mask.window, mask.block_size, varlen and varlen[2:], HOPPER_MODE, TMA_MODE,
            torch.are_deterministic_algorithms_enabled(), tensors[0].device, on,
            *[(t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0) for t in tensors])


def _hopper_documents(mask: MaskArgs, varlen: Varlen | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Hopper kernels' documents (spans, ids) (§14), or None: a varlen call's sequences are its documents, and
    their first positions serve as their ids."""
    if mask.spans is None:
        return None
    return mask.spans, mask.spans[:, 0] if varlen is not None else mask.document_ids


def _as_batch(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """A varlen call's (total, H, D) rows, and its (H, total) lse, as one batch entry: (1, H, total, D), (1, H, total)
    views, which the Hopper kernels take with documents (§14)."""
    return [t.unsqueeze(0) if t.dim() == 2 else t.unsqueeze(0).transpose(1, 2) for t in tensors]


def _planned(key: tuple | None, whole_path: Callable, *call) -> None:
    """Run the plan kept under key on call, or whole_path(), which launches the call and returns its plan."""
    again = None if key is None else _plans.get(key)
    if again is not None:
        again(*call)
        return
    again = whole_path()
    if key is not None:
        remember(_plans, key, again)


def forward_key(causal: bool, mask: MaskArgs, varlen: Varlen | None, q, k, v, terms: Terms = NO_TERMS) -> tuple | None:
    """The forward's plan key (_plan_key), which the autograd Function keeps for its backward: the backward's own key
    is then this one and dO's layout, as everything else it reads or allocates follows from the forward's."""
    return _plan_key("fwd", causal, mask, varlen, q, k, v, *_cu_seqlens(varlen), terms=terms)


def forward(q, k, v, causal: bool, scale: float, mask: MaskArgs = DENSE, varlen: Varlen | None = None,
            key: tuple | None = None, terms: Terms = NO_TERMS) -> tuple[torch.Tensor, torch.Tensor]:
    """-> out (B, Hq, Tq, Dv) in q's dtype, lse (B, Hq, Tq) float32 (natural log; +inf for rows
    that see no key). varlen (§14): out (total_q, Hq, Dv), lse (Hq, total_q). key: forward_key's, if the caller has
    it. terms: §15's; lse then holds the sink's term."""
    Dv = v.shape[-1]
    if varlen is None:
        B, Hq, Tq, _ = q.shape
        o = empty_bthd(B, Hq, Tq, Dv, q)
        lse = torch.empty(B, Hq, Tq, dtype=torch.float32, device=q.device)
    else:
        o = q.new_empty(*q.shape[:2], Dv)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    seqs = _cu_seqlens(varlen)
    key = key or forward_key(causal, mask, varlen, q, k, v, terms)
    _planned(key, lambda: _forward_plan(q, k, v, o, lse, causal, scale, mask, varlen, terms), q, k, v, o, lse, scale,
             *term_values(terms, True), *seqs)
    return o, lse


def _forward_args(q, k, v, o, lse, scale: float, mask: MaskArgs, varlen: Varlen | None, terms: Terms) -> tuple:
    """attn_fwd's arguments, up to the constexprs."""
    Hq, Hkv, Tq, Tk = q.shape[1], k.shape[1], _rows(q, varlen), _rows(k, varlen)
    return (q, k, v, o, lse, *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(o, varlen),
            Hq, Hq // Hkv, Tq, Tk, scale, *_block_list_args(mask, mask.kv_blocks, Tq, Tk), *_sequence_args(varlen),
            *term_args(terms, True))


def _forward_plan(q, k, v, o, lse, causal: bool, scale: float, mask: MaskArgs, varlen: Varlen | None,
                  terms: Terms) -> Callable:
    """The forward's whole path: launch it; -> its plan, again(q, k, v, o, lse, scale, *term values, *cu_seqlens)."""
    B, Tq, Tk = _sizes(q, k, varlen)
    Hq, D = q.shape[1], q.shape[-1]
    hopper = None
    # §12 the warp-specialized kernel: dense calls, and §14 documents (varlen ones as one batch entry); §15 softcap,
    # ALiBi and sinks compiled in where the call has them, not dropout or a value head dim of its own
    # (_hopper_takes), which only the `tl` kernels compute
    documents = _hopper_documents(mask, varlen)
    call = (q, k, v, o, lse) if varlen is None else _as_batch(q, k, v, o, lse)
    if (HOPPER_MODE != "0" and _hopper_takes(terms, q, v, varlen, documents)
            and hopper_forward.forward_supports(*call[:3], dense=mask.kv_blocks is None or documents is not None)):
        # two consumers with documents or the terms (document_tiles, term_tiles)
        tiles = (FORWARD_TILES[D] if terms is NO_TERMS else term_tiles(D)) if documents is None else document_tiles(D)
        # softcap, the slopes, the sinks and their strides, dropout_p and the seed; a plain call passes none (so
        # the launch takes its defaults, the plain build)
        given = {} if terms is NO_TERMS else dict(term_args=term_args(terms, True))

        def hopper_launch(tile):
            return hopper_forward.forward(*call, causal, scale, tile, documents, **given)
        if HOPPER_MODE == "1":
            return hopper_launch(tiles[0]).again  # (documents: no plan kept)
        hopper = (tiles, hopper_launch, (*call, scale, *term_values(terms, True), *(documents or ())))
    # §9: the tuner times each tile with descriptor loads and with pointer loads where both can run, and
    # §12 on Hopper the warp-specialized kernel's tiles beside them
    tma = varlen is None and use_tma(q, k, v, o)
    args = _forward_args(q, k, v, o, lse, scale, mask, varlen, terms)
    constants = {**_constants(q, causal, mask, varlen), **term_constants(terms, q, v, "fwd")}
    choice, launched = tuned_launch("fwd", attn_fwd, lambda block_m, _: (triton.cdiv(Tq, block_m), B * Hq), args,
                                    constants, Tq, Tk, q.dtype, _tiles_divide(mask),
                                    loads=("tma", "pointers") if tma else ("pointers",), hopper=hopper)
    if choice[1] == "hopper":
        return launched.again  # calls with documents keep no plan (_plan_key), so only dense ones repeat it
    values = term_values(terms, True)
    plan = None if tma else planned(launched.again, args, (q, k, v, o, lse, scale, *values, *_cu_seqlens(varlen)))
    if plan is not None:
        return plan

    def again(q, k, v, o, lse, scale, *rest):  # descriptor loads (their scratch allocator), or inputs that alias
        if tma:
            use_scratch_allocator()
        seqs = rest[len(values):]
        launched.again(*_forward_args(q, k, v, o, lse, scale, mask, varlen and Varlen(*seqs, *varlen[2:]),
                                      with_values(terms, rest[:len(values)], True)))
    return again


def backward(do, q, k, v, o, lse, causal: bool, scale: float, mask: MaskArgs = DENSE,
             grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, varlen: Varlen | None = None,
             forward_key: tuple | None = None, terms: Terms = NO_TERMS):
    """-> dq, dk, dv, shaped like q, k, v. grads: tensors to write them into (any strides; the slices of
    one packed gradient, see flash/autograd.py), by default new ones. forward_key: the key of the forward that made
    o and lse (the autograd Function's), which with dO's layout keys the backward's plan. terms: the forward's (§15);
    with sinks -> dq, dk, dv, dsinks."""
    if grads is not None:
        dq, dk, dv = grads
    elif varlen is None:
        B, Hq, Tq, D = q.shape
        Hkv, Tk = k.shape[1], k.shape[2]
        dq, dk, dv = empty_bthd(B, Hq, Tq, D, q), empty_bthd(B, Hkv, Tk, D, k), empty_bthd(B, Hkv, Tk, v.shape[-1], v)
    else:
        dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    seqs = _cu_seqlens(varlen)
    # §15 with sinks the dQ kernel writes each row's sum of P * dP here, for their gradient (sink_grad)
    sink_rows = None if terms.sinks is None else torch.empty_like(lse)
    values = _backward_values(terms, sink_rows)
    if forward_key is not None:
        key = ("bwd", forward_key, grads is not None, torch.are_deterministic_algorithms_enabled(), do.shape,
               do.stride(), do.dtype, do.data_ptr() % 16 == 0)
    else:
        key = _plan_key("bwd", causal, mask, varlen, do, q, k, v, o, lse, dq, dk, dv, *seqs, terms=terms)
    _planned(key, lambda: _backward_plan(do, q, k, v, o, lse, dq, dk, dv, causal, scale, mask, varlen, terms,
                                         sink_rows),
             do, q, k, v, o, lse, dq, dk, dv, scale, *values, *seqs)
    if sink_rows is None:
        return dq, dk, dv
    return dq, dk, dv, sink_grad(terms.sinks, lse, sink_rows, varlen is not None)


def _backward_values(terms: Terms, sink_rows: torch.Tensor | None) -> tuple:
    """The tensors and numbers of a backward call besides its inputs and gradients, in its plan's order: the terms'
    values, then with sinks (§15) the rows their sums go to and the sinks."""
    return term_values(terms, False) + (() if sink_rows is None else (sink_rows, terms.sinks))


def _backward_plan(do, q, k, v, o, lse, dq, dk, dv, causal: bool, scale: float, mask: MaskArgs,
                   varlen: Varlen | None, terms: Terms, sink_rows: torch.Tensor | None = None) -> Callable:
    """The backward's whole path: launch it; -> its plan, again(do, q, k, v, o, lse, dq, dk, dv, scale, *term values,
    *(sink rows, sinks), *cu_seqlens). sink_rows: where the kernels write the sinks' rows (§15), with sinks."""
    _, Tq, Tk = _sizes(q, k, varlen)
    D = q.shape[-1]
    # §13 on Hopper the warp-specialized backward (five matmuls, dQ added up in L2) competes with the two `tl`
    # kernels below; not where determinism was asked for (torch.use_deterministic_algorithms): its dQ's last bits
    # depend on the order the adds land in. It takes dense calls and §14 documents (varlen ones as one batch entry)
    # §15 sinks not with softcap: their gradient sums P * dP per row from exact products (the kernel's add_sink_rows),
    # and with softcap the kernel's P^T takes softcap's factor before dP^T is in
    documents = _hopper_documents(mask, varlen)
    call = (do, q, k, v, o, lse, dq, dk, dv) if varlen is None else _as_batch(do, q, k, v, o, lse, dq, dk, dv)
    batch_do, batch_q, batch_k, batch_v, batch_o, _, *batch_grads = call
    sinks_fit = terms.sinks is None or not terms.softcap  # (above)
    if (HOPPER_MODE != "0" and _hopper_takes(terms, q, v, varlen, documents) and sinks_fit
            and not torch.are_deterministic_algorithms_enabled()
            and hopper_backward.backward_supports(batch_q, batch_k, batch_v, batch_o, batch_do, batch_grads,
                                                dense=mask.kv_blocks is None or documents is not None)):
        # §15 softcap, ALiBi and the sinks' rows compiled in where the call has them
        # the forward's term_args less its sinks (which come as sinks, beside their rows)
        given = {} if terms is NO_TERMS else dict(term_args=term_args(terms, True)[:4] + (None, None)
                                                  + term_args(terms, True)[6:], sink_rows=sink_rows, sinks=terms.sinks)
        values = _backward_values(terms, sink_rows)

        def hopper(tile):
            """-> its Launched: a dense call's again is its plan; with documents (no plan kept, _plan_key) this call"""
            launched = hopper_backward.backward(*call, causal, scale, tile, documents, **given)
            if documents is None:
                return launched
            return launched._replace(again=lambda *_: launched.again(*call, scale, *values, documents=documents))
        tiles = hopper_backward.backward_tiles(D, *batch_grads[1:])
        if HOPPER_MODE == "1":
            tile = tiles[0]
        else:
            tile = backward_choice(lambda: _tl_backward(do, q, k, v, o, lse, dq, dk, dv, causal, scale, mask, varlen,
                                                        terms, sink_rows),
                                   hopper, tiles, D, causal, documents is not None, q.dtype, Tq, Tk,
                                   (do, q, k, v, o, lse, dq, dk, dv, scale, *values, *_cu_seqlens(varlen)),
                                   tuple(name for name in term_constants(terms, q, v, "fwd")))
        if tile is not None:
            return hopper(tile).again
    return _tl_backward(do, q, k, v, o, lse, dq, dk, dv, causal, scale, mask, varlen, terms, sink_rows)


def _tl_backward(do, q, k, v, o, lse, dq, dk, dv, causal: bool, scale: float, mask: MaskArgs,
                 varlen: Varlen | None, terms: Terms = NO_TERMS, sink_rows: torch.Tensor | None = None) -> Callable:
    """The `tl` backward into dq, dk, dv: the dQ kernel (which also writes Delta, and with sinks their rows into
    sink_rows, §15), then the dK/dV kernel. -> its plan, again(do, q, k, v, o, lse, dq, dk, dv, scale, *term values,
    *(sink rows, sinks), *cu_seqlens)."""
    B, Tq, Tk = _sizes(q, k, varlen)
    Hq, Hkv = q.shape[1], k.shape[1]
    n_values = len(term_values(terms, False))
    n_rows = 2 if terms.sinks is not None else 0  # the sinks' rows and the sinks (the Hopper backward's; not read)

    def args(do, q, k, v, o, lse, dq, dk, dv, delta, scale, *rest):
        """-> the dQ kernel's arguments and the dK/dV kernel's, up to the constexprs"""
        call = varlen and Varlen(*rest[n_values + n_rows:], *varlen[2:])
        kernel_terms = term_args(with_values(terms, rest[:n_values], False), False)
        sink_rows = rest[n_values] if n_rows else None
        rows_q, rows_k = _rows(q, varlen), _rows(k, varlen)
        seq_args = (Hq, Hq // Hkv, rows_q, rows_k, scale)
        strides = [_strides(t, varlen) for t in (q, k, v, o, do, dq, dk, dv)]
        sq, sk, sv, so, sdo, sdq, sdk, sdv = strides
        return ((q, k, v, o, do, dq, lse, delta, *sq, *sk, *sv, *so, *sdo, *sdq, *seq_args,
                 *_block_list_args(mask, mask.kv_blocks, rows_q, rows_k), *_sequence_args(call), *kernel_terms,
                 sink_rows),
                (q, k, v, do, dk, dv, lse, delta, *sq, *sk, *sv, *sdo, *sdk, *sdv, *seq_args,
                 *_block_list_args(mask, mask.q_blocks, rows_q, rows_k), *_sequence_args(call), *kernel_terms))
    # Delta (shaped as lse) after the gradients: the plan allocates it anew with every call
    call = (do, q, k, v, o, lse, dq, dk, dv, torch.empty_like(lse), scale, *_backward_values(terms, sink_rows),
            *_cu_seqlens(varlen))
    dq_args, dkdv_args = args(*call)
    constants = _constants(q, causal, mask, varlen)
    # dQ first: it also writes Delta (§5), which the dK/dV kernel reads; stream order makes it ready
    _, dq_launched = tuned_launch("dq", attn_bwd_dq, lambda block_m, _: (triton.cdiv(Tq, block_m), B * Hq),
                                  dq_args, {**constants, **term_constants(terms, q, v, "dq")}, Tq, Tk, q.dtype,
                                  _tiles_divide(mask))
    _, dkdv_launched = tuned_launch("dkdv", attn_bwd_dkdv, lambda _, block_n: (triton.cdiv(Tk, block_n), B * Hkv),
                                    dkdv_args, {**constants, **term_constants(terms, q, v, "dkdv")}, Tq, Tk, q.dtype,
                                    _tiles_divide(mask))
    # a later call of the plan key fills its tensors' places in these arguments (launch.planned)
    dq_plan, dkdv_plan = planned(dq_launched.again, dq_args, call), planned(dkdv_launched.again, dkdv_args, call)

    def again(*call):
        call = (*call[:9], torch.empty_like(call[5]), *call[9:])
        if dq_plan is None or dkdv_plan is None:  # inputs that alias: each call's arguments anew
            dq_args, dkdv_args = args(*call)
            dq_launched.again(*dq_args)
            dkdv_launched.again(*dkdv_args)
        else:
            dq_plan(*call)
            dkdv_plan(*call)
    return again
