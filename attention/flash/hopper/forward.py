"""The forward pass on Hopper (H100, H200), host side (§12): whether the warp-specialized kernel can run a call,
and its launch. The kernel itself, FlashAttention-3's layout in Gluon, is gluon_forward.attn_fwd_ws, which says which
warps do what and how they meet.

    launched = forward(q, k, v, o, lse, causal, scale, tile)   # tile: one of FORWARD_TILES; launched.again repeats

`tl` cannot say any of this on Hopper (docs/perf_notes.md: Triton 3.6's automatic warp specialization hangs there,
and `tl` waits for every matmul at once). dispatch.forward's tuner times this kernel against the `tl` one on sm_90 and
keeps the faster for each shape. Gluon has no CPU interpreter: its tests run on the GPU (tests/test_triton_hopper.py),
and CI builds it for sm_90 (benchmarks/hopper_build.py).
"""
import torch
import triton

from ..device import HAS_GLUON, INTERPRET, is_hopper, sm_count
from ..launch import Launched, launch, planned
from .shapes import FORWARD_TILES, REGS, ROWS, HopperForwardTile

if HAS_GLUON:
    from .gluon_common import descriptor, document_args
    from .gluon_forward import attn_fwd_ws


# where term_args holds values (softcap, the slopes, the sinks, dropout_p, the seed); the rest are the slopes' and
# the sinks' strides (backward.backward's term_args leave the sinks' two places None)
VALUES = (0, 1, 4, 6, 7)


def term_values(term_args: tuple) -> tuple:
    """§15, §16 the values among the kernels' term arguments (their strides are the plan's), those a call has: what
    a plan takes anew with every call."""
    return tuple(term_args[i] for i in VALUES if term_args[i] is not None)


def with_term_values(term_args: tuple, values: tuple) -> tuple:
    """term_args with another call's values (term_values' order) in their places."""
    given, args = iter(values), list(term_args)
    for i in VALUES:
        if args[i] is not None:
            args[i] = next(given)
    return tuple(args)


def tma_can_read(*tensors: torch.Tensor) -> bool:
    """Whether the copy engine (TMA) reads these tensors: unit stride along the head dim, every other stride
    and the start 16-byte aligned (also the `tl` forward's descriptor loads' rule, dispatch.use_tma)."""
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1]) for t in tensors)


def runs_on(q: torch.Tensor) -> bool:
    """Whether the kernels run for queries like q: Gluon present, an sm_90 GPU (wgmma is Hopper's alone), fp16/bf16,
    head dim 64 or 128."""
    if not HAS_GLUON or INTERPRET:  # Gluon has no CPU interpreter
        return False
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in FORWARD_TILES and is_hopper(q.device)


def forward_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dense: bool) -> bool:
    """Whether this kernel can run the call: where it runs (runs_on), a dense mask, and tensors the copy engine reads.
    Anything else takes the `tl` forward."""
    return dense and runs_on(q) and tma_can_read(q, k, v)


def alibi_causal(causal: bool, term_args: tuple, row_src) -> dict:
    """§15 the kernels' ALIBI_CAUSAL switch: {ALIBI_CAUSAL: True} for a causal call with ALiBi slopes (not a gathered
    problem's), whose builds fold the bias's row part out of the scores (gluon_softmax.tile_terms' FOLD); no
    constant otherwise, so other calls build and launch as before."""
    slopes = term_args[1] if len(term_args) > 1 else None
    return dict(ALIBI_CAUSAL=True) if causal and slopes is not None and row_src is None else {}


def alibi_full(causal: bool, term_args: tuple, row_src) -> dict:
    """§15 the forward's ALIBI_FULL switch: {ALIBI_FULL: True} for a call with ALiBi slopes and no causal mask (not a
    gathered problem's), whose build folds the bias per key tile (gluon_softmax.mirrored_terms); no constant
    otherwise."""
    return dict(ALIBI_FULL=True) if not causal and alibi_causal(True, term_args, row_src) else {}


def key_problem(k: torch.Tensor, gathered: bool, key_tile: int) -> tuple[int, int, tuple[int, int]]:
    """-> (Hkv, Tk, (KEY_HEADS, KEY_T)) of the kernels' keys: k's own heads and length; or for a gathered problem
    (§11 "Keys read where they are") one sequence of k's (B, Hkv, T) rows, which the producers map back to k's place
    of each key tile (gluon_common.key_block), so a tile of key_tile rows must not straddle two heads."""
    Hkv, T = k.shape[1], k.shape[2]
    if not gathered:
        return Hkv, T, (0, 0)  # KEY_HEADS, KEY_T unused
    n = k.shape[0] * Hkv * T
    if n != T and T % key_tile:
        raise ValueError(f"keys of {T} rows per head: a gathered problem's key tiles of {key_tile} must not straddle "
                         "two heads; pass k and v as one flat (1, 1, n, D) sequence")
    return 1, n, (Hkv, T)


def forward(q, k, v, o, lse, causal: bool, scale: float, tile: HopperForwardTile,
            documents: tuple[torch.Tensor, torch.Tensor] | None = None,
            row_src: torch.Tensor | None = None, term_args: tuple = (None,) * 8) -> Launched:
    """Write O into o (B, Hq, Tq, D), which the copy engine writes (tma_can_read; dispatch.empty_bthd's tensors
    are), and lse (B, Hq, Tq) float32, natural log. q (B, Hq, Tq, D), k, v (B, Hkv, Tk, D) as `supports` allows.
    tile: one of FORWARD_TILES. documents: (spans, ids) where attention
    stays inside documents (Tq == Tk, §14): spans (B, 2, T) int32 (block_mask.document_spans), ids (B, T) integer
    with a unit last stride; or spans (B, 2, Tq) of the keys each row sees and ids None (MoBA's rows, §11).
    row_src (n,) int32: a gathered problem (§11) of n query rows, row i being row row_src[i] of q's B*Hq*T,
    numbered (b * Hq + h) * T + t (-1: a row of zeros); o (1, 1, n, D) and lse (1, 1, n) are then the rows', and
    the keys k's and v's (B, Hkv, Tk) rows as one sequence, numbered as q's, in any strides (whole key tiles per
    head, or a flat (1, 1, n, D) k and v).
    term_args: §15's (softcap, slopes, stride_slopes_b, stride_slopes_h, sinks, stride_sinks) and §16's (dropout_p,
    seed) as terms.term_args gives them, None for a term the call does not have (the kernel's build is then the one
    without it).
    -> Launched: the compiled kernel (the tuner logs its registers) and again(q, k, v, o, lse, scale, *term values,
    *documents), the same launch for tensors shaped, strided and aligned like these (None for a gathered problem);
    the term values are term_values(term_args)'s, the terms' values of that call."""
    B, Hq, Tq, _ = o.shape  # the problem's query rows
    block_n, k_stages, v_stages, persistent, consumers = tile
    Hkv, Tk, key_sizes = key_problem(k, row_src is not None, block_n)
    if not tma_can_read(o):
        raise ValueError(f"o with strides {o.stride()}: the Hopper forward stores O by TMA, which needs a unit last "
                         "stride and 16-byte aligned start and strides; allocate it with dispatch.empty_bthd")
    if row_src is not None and consumers != 2:
        raise ValueError(f"tile {tile}: a gathered problem runs two consumers (_item_sources)")
    launch_regs, consumer_regs = REGS[consumers]
    diag = Tk - Tq if causal else Tk  # §6: row i sees keys <= i + diag (and < Tk)
    n_work = triton.cdiv(Tq, consumers * ROWS.value) * B * Hq
    # persistent: one program per SM (one fits: its warps fill the register file); its producer
    # loads the next item's Q, K and V while the consumers finish the last one, instead of a new program starting.
    # It walks pairs of items, under the causal mask a long and a short tile, so every program's share is as long.
    per_turn = 2 if persistent else 1
    programs = min(triton.cdiv(n_work, per_turn), sm_count(q.device)) if persistent else n_work
    # Q: a descriptor of q, or for a gathered problem q itself, whose rows the producer copies
    descriptors = (descriptor(q, ROWS.value) if row_src is None else q, descriptor(k, block_n), descriptor(v, block_n),
                   descriptor(o, ROWS.value))
    sizes = (o.stride(0), o.stride(1), o.stride(2), Hq, Hq // Hkv, Tq, Tk, diag)
    gathered = (None, 0, 0, 0, 0, 0) if row_src is None else (row_src, *q.stride()[:3], *q.shape[1:3])
    args = (*descriptors, o, lse, *sizes, scale, n_work, per_turn, *document_args(documents), *gathered, *term_args,
            *key_sizes)
    first = launch(attn_fwd_ws, (programs,), args, BLOCK_N=block_n, K_STAGES=k_stages, V_STAGES=v_stages,
                   CONSUMERS=consumers, CONSUMER_REGS=consumer_regs, num_warps=4, maxnreg=launch_regs,
                   **alibi_causal(causal, term_args, row_src), **alibi_full(causal, term_args, row_src))
    if row_src is not None:
        return Launched(first.compiled, None)
    values = term_values(term_args)
    plan = planned(first.again, args, (q, k, v, o, lse, scale, *values, *(documents or ())))
    if plan is None:  # inputs that alias: each call's arguments anew (each descriptor's place takes its tensor)
        def plan(q, k, v, o, lse, scale, *rest):
            documents = rest[len(values):]
            first.again(q, k, v, o, o, lse, *sizes, scale, n_work, per_turn, *document_args(documents or None),
                        *gathered, *with_term_values(term_args, rest[:len(values)]), *key_sizes)
    return Launched(first.compiled, plan)
