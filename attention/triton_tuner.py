"""The tile each kernel runs with (§9): candidates by head dim, timed on a kernel's first call of a shape, the
fastest kept for every later call of that shape's key.

    choice, launched = tuned_launch("fwd", triton_flash.attn_fwd, grid_of_tile, args, constants, Tq, Tk, dtype)

Tiles are (BLOCK_M, BLOCK_N, num_warps, num_stages): BLOCK_M counts query rows, BLOCK_N key rows. On Hopper the
forward's candidates include the warp-specialized kernel's tiles (triton_hopper.py, §12), and the backward's choice is
between the two `tl` kernels and the warp-specialized backward (triton_hopper_backward.py, §13): backward_choice.
NANOFLASH_AUTOTUNE=0 takes the first candidate that fits instead of timing (quick tests).
"""
import functools
import os
import statistics
from typing import NamedTuple

import torch
import triton
from triton.runtime.errors import OutOfResources

from .launch import Launched, launch
from .triton_support import INTERPRET

# Candidates by head dim padded to a power of two; the first is the one taken when tuning is off. Larger heads leave
# room for fewer rows. The lists serve dense and block-sparse calls (§10): long dense rows pick the large tiles, the
# short rows of a window or of documents the small ones.
HOPPER_TILES = {
    "fwd": {
        64: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3)],
        128: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)],
        256: [(64, 64, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (32, 32, 4, 1)],
    },
    # dK/dV keeps two fp32 (BLOCK_N, D) accumulators: wide heads want more warps to hold them
    "dkdv": {
        64: [(64, 128, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 2)],
        128: [(64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2)],
        256: [(32, 64, 8, 2), (64, 64, 8, 2), (32, 32, 4, 1)],
    },
    "dq": {
        64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 2)],
        128: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2)],
        256: [(64, 32, 8, 2), (64, 64, 8, 2), (32, 32, 4, 1)],
    },
}
# Under the interpreter there is nothing to tune: one small tile, unequal in M and N so the CPU tests cover tiles
# that straddle the causal diagonal at different offsets.
INTERPRETER_TILES = {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
# Hopper has 227 KiB of shared memory per block; leave room for Triton's own scratch buffers.
SMEM_BUDGET = 200 * 1024

# How a candidate is timed (docs/perf_notes.md, "How we measure" and "The tuner"):
# - Its launch as a plan will repeat it (launch.py's `again`), not the whole first-call path: that path's host time
#   is paid once per key, and at small shapes it would be timed too, ranking launch paths instead of kernels.
# - At the clock it will run at. Under sustained load a GPU holds its power cap by lowering its clock, and lowers it
#   more for kernels that draw more per clock; timed in short turns, a kernel runs at the clock the one before it left.
#   So all compile first, the first candidate heats the GPU for HEAT_MS, and each runs WARMUP_MS on its own before
#   do_bench times it for REP_MS.
# - In ROUNDS rounds, the order rotating, its time the median of its rounds: timed once each in a fixed order, a
#   candidate's time depends on the one before it.
HEAT_MS, WARMUP_MS, REP_MS, ROUNDS = 100, 50, 25, 3


def head_dim_class(block_d: int) -> int:
    # heads of 16 and 32 take the 64 tiles: their tiles are small whatever the row counts
    return max(64, block_d)


def smem_bytes(kernel: str, tile: tuple, block_d: int, elem_bytes: int) -> int:
    """Shared memory a tile config needs: the tiles a program holds plus num_stages copies of the
    tiles it streams (software pipelining keeps that many loads in flight)."""
    block_m, block_n, _, stages = tile
    held, streamed = {
        "fwd": (block_m, 2 * block_n),  # holds Q; streams K, V
        "dq": (2 * block_m, 2 * block_n),  # holds Q, dO; streams K, V
        "dkdv": (2 * block_n, 2 * block_m),  # holds K, V; streams Q, dO
    }[kernel]
    return (held + stages * streamed) * block_d * elem_bytes


def candidate_tiles(kernel: str, block_d: int, elem_bytes: int, mask_block: int | None = None) -> list[tuple]:
    """The tiles worth timing for one call: its head-dim class's candidates that fit in shared memory for this
    dtype, in table order (2-4 of them, so first-call tuning stays short), and for a block-sparse call (§10) that
    divide the mask's blocks, which the kernels walk tile by tile."""
    tiles = [INTERPRETER_TILES[kernel]] if INTERPRET else HOPPER_TILES[kernel][head_dim_class(block_d)]
    kept = [tile for tile in tiles if smem_bytes(kernel, tile, block_d, elem_bytes) <= SMEM_BUDGET
            and (mask_block is None or mask_block % tile[0] == 0 and mask_block % tile[1] == 0)]
    if not kept:
        raise ValueError(f"a block mask with block_size={mask_block} is smaller than every {kernel} tile of the "
                         f"kernel for head_dim {block_d}; build the BlockMask with block_size=64 (the default)")
    return kept


class TuningKey(NamedTuple):
    """A kernel's tuning key (tuned_launch). The sequence lengths are power-of-two buckets, so a new T reuses the
    choice of its bucket instead of timing the candidates again."""
    kernel: str
    constants: tuple  # the constexprs' (name, value) pairs
    loads: tuple | None
    hopper: bool  # whether §12's kernel was a candidate
    dtype: torch.dtype
    Tq_bucket: int
    Tk_bucket: int


class BackwardKey(NamedTuple):
    """The key of the backward's choice on Hopper (backward_choice): the sizes, bucketed as in TuningKey, and the
    Hopper kernel's candidate tiles (its staged ones only where TMA can write the gradients)."""
    head_dim: int
    causal: bool
    documents: bool  # §14: attention kept inside documents (the `tl` kernels then walk block lists)
    dtype: torch.dtype
    Tq_bucket: int
    Tk_bucket: int
    tiles: tuple


# tuning key -> the fastest (tile, variant); backward key -> None (the `tl` kernels) or the Hopper kernel's tile
best_tile: dict[TuningKey, tuple] = {}
best_backward: dict[BackwardKey, tuple | None] = {}
# a list to append each tuning's timings to (benchmarks/train_step.py reads it), or None
tuning_log: list | None = None


def tuning_enabled() -> bool:
    return os.environ.get("NANOFLASH_AUTOTUNE", "1") != "0" and not INTERPRET


def tuned_launch(kernel: str, jit_fn, grid_of_tile, args, constants: dict, Tq: int, Tk: int, dtype,
                 block: int | None = None, loads: tuple[str, ...] | None = None, hopper=None) -> tuple[tuple, Launched]:
    """Launch jit_fn with the fastest tile for this call's key, timing the candidates on the key's first call.
    -> the choice, (tile, variant), and its Launched (launch.py), whose `again` takes jit_fn's arguments, or for the
    Hopper kernel what its launch's `again` takes.
    args: the kernel's arguments, or a function of BLOCK_M giving them (for kernels whose work lists are cut in
    tiles, triton_moba.py). block: a size the tiles must divide (§10, §11). loads: the settings of the kernel's TMA
    switch to time with every tile, "tma" (descriptor loads) and "pointers", or only "pointers" where descriptors
    cannot read the tensors; None for a kernel without the switch. hopper: (tiles, launch, call) of the
    warp-specialized forward (§12) where it can run the call, timed beside jit_fn's tiles; launch(tile) runs it and
    returns its Launched, whose again takes call.

    Not @triton.autotune: that rebuilds its key from every one of the ~45 arguments on each call, host time that
    outlasts the kernels at small shapes (docs/perf_notes.md, "Host time"); here the key is a small tuple."""
    if loads is not None and "tma" in loads:
        use_scratch_allocator()

    def args_of(block_m):
        return args(block_m) if callable(args) else args

    def run(choice):
        tile, variant = choice
        if variant == "hopper":
            return hopper[1](tile)
        block_m, block_n, warps, stages = tile
        switch = {} if variant is None else {"TMA": variant == "tma"}
        return launch(jit_fn, grid_of_tile(block_m, block_n), args_of(block_m), **constants, **switch,
                      BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)

    def repeated(choice):
        """run(choice), then -> a function that launches it again as a plan will (what the tuner times)"""
        tile, variant = choice
        return functools.partial(run(choice).again, *(hopper[2] if variant == "hopper" else args_of(tile[0])))

    key = TuningKey(kernel, tuple(constants.items()), loads, hopper is not None, dtype,
                    triton.next_power_of_2(Tq), triton.next_power_of_2(Tk))
    choice = best_tile.get(key)
    if choice is not None:
        return choice, run(choice)
    # in the caller's order of loads (descriptors first: with tuning off they are the ones taken, where the tensors
    # allow them); the Hopper kernel's tiles last, so tuning off never takes them
    candidates = [(tile, variant) for tile in candidate_tiles(kernel, constants["BLOCK_D"], dtype.itemsize, block)
                  for variant in (loads or [None])]
    candidates += [(tile, "hopper") for tile in (hopper[0] if hopper else [])]
    if not tuning_enabled():
        choice, launched = first_that_fits(candidates, run)  # launched: this call is done
        best_tile[key] = choice
        return choice, launched
    times = timed({choice: functools.partial(repeated, choice) for choice in candidates})
    choice = min(times, key=times.get)
    best_tile[key] = choice
    launched = run(choice)
    if tuning_log is not None:  # with what the compiler made of the chosen tile
        tuning_log.append(dict(kernel=kernel, constants=constants, Tq=Tq, Tk=Tk, times_ms=times,
                               registers=launched.compiled.n_regs, spills=launched.compiled.n_spills,
                               wgmma=launched.compiled.asm["ptx"].count("wgmma.mma_async")))
    return choice, launched


def backward_choice(tl_backward, hopper_backward, tiles: list[tuple], head_dim: int, causal: bool, documents: bool,
                    dtype, Tq: int, Tk: int, call: tuple) -> tuple | None:
    """The backward for these sizes: None for the `tl` kernels (each with its own tuned tile, tuned_launch), or the
    Hopper kernel's tile. On the key's first call the candidates are timed, each run writing the gradients, which the
    caller's run then writes again. tl_backward() -> the `tl` plan; hopper_backward(tile) -> the Hopper kernel's
    Launched; both plans take call."""
    key = BackwardKey(head_dim, causal, documents, dtype, triton.next_power_of_2(Tq), triton.next_power_of_2(Tk),
                      tuple(tiles))
    if key not in best_backward:
        if not tuning_enabled():
            best_backward[key] = None
        else:
            # timed as their plans (the `tl` kernels' first run tunes their tiles, so their time is the tuned one)
            times = timed({None: lambda: functools.partial(tl_backward(), *call),
                           **{t: lambda t=t: functools.partial(hopper_backward(t).again, *call) for t in tiles}})
            best_backward[key] = min(times, key=times.get)
            if tuning_log is not None:
                tuning_log.append(dict(kernel="bwd", key=key, times_ms=times))
    return best_backward[key]


def timed(first_runs: dict) -> dict:
    """{choice: a function that runs it the first time (a compile) and returns one that runs it again} ->
    {choice: the median ms of its rounds}; inf for one that does not fit in shared memory (smem_bytes is an
    estimate: a kernel that stages more than it, MoBA's gathers say, may not)."""
    times, again = {}, {}
    for choice, first_run in first_runs.items():
        try:
            again[choice] = first_run()
        except OutOfResources:
            times[choice] = float("inf")
    choices = list(again)
    rounds = {choice: [] for choice in choices}
    for r in range(ROUNDS if choices else 0):  # none left when nothing fits
        for i, choice in enumerate(choices[r % len(choices):] + choices[:r % len(choices)]):
            warmup = WARMUP_MS + (HEAT_MS if r == i == 0 else 0)
            rounds[choice].append(triton.testing.do_bench(again[choice], warmup=warmup, rep=REP_MS,
                                                          return_mode="median"))
    times.update({choice: statistics.median(ms) for choice, ms in rounds.items()})
    return times


def first_that_fits(candidates: list[tuple], run) -> tuple[tuple, Launched]:
    """Launch the first candidate that compiles within the GPU's shared memory (tuning off); -> that candidate and
    its launch. The last candidate's error, if it fails too, is the caller's."""
    for choice in candidates[:-1]:
        try:
            return choice, run(choice)
        except OutOfResources:
            continue
    return candidates[-1], run(candidates[-1])


def tuned_choices(head_dim: int, causal: bool, dtype: torch.dtype, Tq: int, Tk: int) -> dict:
    """What the tuner has chosen so far for dense calls of these sizes, by kernel: "fwd", "dq", "dkdv" ->
    (tile, variant), variant "hopper" being §12's kernel with a (BLOCK_N, K_STAGES, V_STAGES, PERSISTENT, CONSUMERS)
    tile; "bwd" -> None where the `tl` pair (dq, dkdv) runs, or §13's kernel's (STAGES, DKDV_STAGED) tile. Kernels
    not tuned yet are left out; where calls of several layouts were tuned, the last one's. benchmarks/attention.py
    records it per cell."""
    buckets = (triton.next_power_of_2(Tq), triton.next_power_of_2(Tk))
    dense = dict(HEAD_DIM=head_dim, CAUSAL=causal, SPARSE=False, WINDOW=False, DOCS=False, BITS=False)
    found = {}
    for key, choice in best_tile.items():
        constants = dict(key.constants)
        if ((key.dtype, key.Tq_bucket, key.Tk_bucket) == (dtype, *buckets)
                and all(constants.get(name) == value for name, value in dense.items())):
            found[key.kernel] = choice
    for key, choice in best_backward.items():
        if (key.head_dim, key.causal, key.documents, key.dtype, key.Tq_bucket, key.Tk_bucket) == (
                head_dim, causal, False, dtype, *buckets):
            found["bwd"] = choice  # whichever candidate tiles
    return found


def use_scratch_allocator() -> None:
    """Device-side tensor descriptors (§9 TMA loads) live in a scratch buffer the launch allocates. The setting is
    per thread (a context variable), and autograd runs the backward on a thread of its own: set it before each
    launch that needs it."""
    triton.set_allocator(_scratch)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cpu" if INTERPRET else "cuda")
