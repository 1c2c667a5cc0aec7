"""The tile each kernel runs with (§9): candidates by head dim, timed on a kernel's first call of a shape, the
fastest kept for every later call of that shape's key, in this process and on disk for every later one.

    choice, launched = tuned_launch("fwd", tl_forward.attn_fwd, grid_of_tile, args, constants, Tq, Tk, dtype)

The `tl` kernels' tiles are tiles.TlTile. On Hopper the forward's candidates include the warp-specialized kernel's
tiles (hopper/shapes.HopperForwardTile, §12), and the backward's choice is between the two `tl` kernels and the
warp-specialized backward (HopperBackwardTile, §13): backward_choice.

Choices persist (tuning_store.py): a key timed once on a GPU model, Triton version and package version is read back
by every later process, and the repository ships the choices for the H100 and the H200 (tuned/), so a first run there
times nothing. NANOFLASH_AUTOTUNE=0 takes the first candidate that fits instead of timing or reading choices (quick
tests), and so does a key too small to time (TIMED_FROM).
"""
import functools
import os
import re
import statistics
from pathlib import Path
from typing import NamedTuple

import torch
import triton
from triton.runtime.errors import OutOfResources

from ..version import __version__
from .device import INTERPRET
from .hopper.shapes import HopperBackwardTile, HopperForwardTile
from .launch import Launched, launch
from .tiles import TlTile, candidate_tiles
from .tuning_store import TuningStore

SHIPPED_CHOICES = Path(__file__).parent / "tuned"  # benchmarks/tune.py writes them on each GPU model

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
# A key whose Tq and Tk buckets multiply to less than this is not timed but takes the first candidate that fits (for
# the backward, the `tl` pair: the fewest launches): each head's kernel runs for microseconds, a call is host-bound,
# and the timings cannot tell the candidates apart, while timing them compiles every one of them: seconds of a
# process's start-up, for a sample's prefill of a short prompt say (docs/perf_notes.md, "Start-up").
TIMED_FROM = 256 * 256
# §15 the switches of FlashAttention's terms that the Hopper kernels compile in (terms.term_constants). A key with
# them on, where the Hopper kernels are candidates, is not timed: it takes the choice of its plain key (the same key
# without them) if that key has one, in this process or on disk (the shipped choices), else the first candidate that
# fits (the `tl` kernels: for the backward the `tl` pair). The terms change no candidate, so the plain choice is one of
# the term key's; what they cost (a few operations per score, more registers) is alike for every tile, so the tile
# fastest without them is taken as the best guess with them, and no process start compiles and times every tile
# again for each combination of terms. Term keys without the Hopper candidates are tuned as any key is.
TERM_SWITCHES = ("SOFTCAP", "ALIBI", "SINKS")


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


# tuning key -> the fastest (tile, variant), variant "hopper" for §12's kernel, else the `tl` kernel's TMA switch;
# backward key -> None (the `tl` kernels) or the Hopper kernel's tile
best_tile: dict[TuningKey, tuple[TlTile | HopperForwardTile, str | None]] = {}
best_backward: dict[BackwardKey, HopperBackwardTile | None] = {}
# a list to append each tuning's timings to (benchmarks/train_step.py reads it), or None
tuning_log: list | None = None


def tuning_enabled() -> bool:
    return os.environ.get("NANOFLASH_AUTOTUNE", "1") != "0" and not INTERPRET


@functools.cache
def choices_store(device: int) -> TuningStore:
    """The choices kept on disk for this GPU model (tuning_store.py), opened on the first key a process tunes."""
    return TuningStore.open(gpu=torch.cuda.get_device_name(device), triton=triton.__version__, package=__version__,
                            shipped_dir=SHIPPED_CHOICES)


def stored_key(key: tuple) -> str:
    """key as the store keeps it: its repr without field names, tile type names or "torch." (the shipped files are
    one line a key, and the names would be most of each line); a key's fields keep their order, so it stays unique:
    TuningKey('fwd',(('HEAD_DIM',64),...),('pointers',),True,bfloat16,8192,8192)."""
    return re.sub(r"\b\w+=|torch\.|\b\w+Tile(?=\()", "", repr(key)).replace(", ", ",")


def _stored_choice(key: tuple, candidates: list):
    """The choice kept on disk for key if it is still one of the candidates (a stored tile a newer table dropped is
    timed anew), else None; JSON holds a tile as a list, so each candidate is compared in that form."""
    stored = choices_store(torch.cuda.current_device()).get(stored_key(key))
    return next((choice for choice in candidates if _as_json(choice) == stored), None)


def _as_json(choice):
    """A choice as tuning_store keeps it: tuples (tiles are named tuples) as lists, all the way down."""
    return [_as_json(part) for part in choice] if isinstance(choice, tuple) else choice


def _keep(key: tuple, choice) -> None:
    choices_store(torch.cuda.current_device()).put(stored_key(key), _as_json(choice))


def tuned_launch(kernel: str, jit_fn, grid_of_tile, args, constants: dict, Tq: int, Tk: int, dtype,
                 block: int | None = None, loads: tuple[str, ...] | None = None, hopper=None) -> tuple[tuple, Launched]:
    """Launch jit_fn with the fastest tile for this call's key, timing the candidates on the key's first call.
    -> the choice, (tile, variant), and its Launched (launch.py), whose `again` takes jit_fn's arguments, or for the
    Hopper kernel what its launch's `again` takes.
    args: the kernel's arguments, or a function of BLOCK_M giving them (for kernels whose work lists are cut in
    tiles, moba/tl_kernels.py). block: a size the tiles must divide (§10, §11). loads: the settings of the kernel's
    TMA switch to time with every tile, "tma" (descriptor loads) and "pointers", or only "pointers" where descriptors
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
        switch = {} if variant is None else {"TMA": variant == "tma"}
        return launch(jit_fn, grid_of_tile(tile.block_m, tile.block_n), args_of(tile.block_m), **constants, **switch,
                      BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, num_warps=tile.warps, num_stages=tile.stages)

    def repeated(choice):
        """run(choice), then -> a function that launches it again as a plan will (what the tuner times)"""
        tile, variant = choice
        return functools.partial(run(choice).again, *(hopper[2] if variant == "hopper" else args_of(tile.block_m)))

    key = TuningKey(kernel, tuple(constants.items()), loads, hopper is not None, dtype,
                    triton.next_power_of_2(Tq), triton.next_power_of_2(Tk))
    choice = best_tile.get(key)
    if choice is not None:
        return choice, run(choice)
    # in the caller's order of loads (descriptors first: with tuning off they are the ones taken, where the tensors
    # allow them); the Hopper kernel's tiles last, so tuning off never takes them
    # the wider of q's and v's head dims (§15: v's may be its own) sizes the tiles
    block_d = max(constants["BLOCK_D"], constants.get("BLOCK_DV", 0))
    candidates = [(tile, variant) for tile in candidate_tiles(kernel, block_d, dtype.itemsize, block)
                  for variant in (loads or [None])]
    candidates += [(tile, "hopper") for tile in (hopper[0] if hopper else [])]
    if not tuning_enabled():
        choice, launched = first_that_fits(candidates, run)  # launched: this call is done
        best_tile[key] = choice
        return choice, launched
    choice = best_tile[key] = _stored_choice(key, candidates)
    if choice is not None:
        return choice, run(choice)
    plain = key._replace(constants=tuple(c for c in key.constants if c[0] not in TERM_SWITCHES))
    if hopper is not None and plain != key:  # a term key (TERM_SWITCHES): the plain key's choice, untimed
        choice = best_tile.get(plain) or _stored_choice(plain, candidates)
        if choice is None or choice not in candidates:
            choice, launched = first_that_fits(candidates, run)
        else:
            launched = run(choice)
        best_tile[key] = choice
        return choice, launched
    if key.Tq_bucket * key.Tk_bucket < TIMED_FROM:
        choice, launched = first_that_fits(candidates, run)
        best_tile[key] = choice
        return choice, launched
    times = timed({choice: functools.partial(repeated, choice) for choice in candidates})
    choice = best_tile[key] = min(times, key=times.get)
    _keep(key, choice)
    launched = run(choice)
    if tuning_log is not None:  # with what the compiler made of the chosen tile
        tuning_log.append(dict(kernel=kernel, constants=constants, Tq=Tq, Tk=Tk, times_ms=times,
                               registers=launched.compiled.n_regs, spills=launched.compiled.n_spills,
                               wgmma=launched.compiled.asm["ptx"].count("wgmma.mma_async")))
    return choice, launched


def backward_choice(tl_backward, hopper_backward, tiles: list[HopperBackwardTile], head_dim: int, causal: bool,
                    documents: bool, dtype, Tq: int, Tk: int, call: tuple,
                    terms: tuple[str, ...] = ()) -> HopperBackwardTile | None:
    """The backward for these sizes: None for the `tl` kernels (each with its own tuned tile, tuned_launch), or the
    Hopper kernel's tile. On the key's first call the candidates are timed, each run writing the gradients, which the
    caller's run then writes again. tl_backward() -> the `tl` plan; hopper_backward(tile) -> the Hopper kernel's
    Launched; both plans take call. terms: the §15 switches the call has (TERM_SWITCHES' names): its key is then
    (the plain key, terms), which takes the plain key's choice untimed (TERM_SWITCHES), so a plain key's is as it was."""
    plain = BackwardKey(head_dim, causal, documents, dtype, triton.next_power_of_2(Tq), triton.next_power_of_2(Tk),
                        tuple(tiles))
    key = (plain, tuple(terms)) if terms else plain
    if key in best_backward:
        return best_backward[key]
    if not tuning_enabled():
        best_backward[key] = None
        return None
    if terms:  # the plain key's choice, untimed; else the `tl` pair, the first candidate (TERM_SWITCHES)
        if plain in best_backward:
            best_backward[key] = best_backward[plain]
        else:
            stored = _stored_choice(plain, ["tl", *tiles])
            best_backward[key] = None if stored in (None, "tl") else stored
        return best_backward[key]
    # the `tl` pair is kept on disk as "tl" (a missing key reads None)
    candidates = ["tl", *tiles]
    choice = _stored_choice(key, candidates)
    if choice is None and key.Tq_bucket * key.Tk_bucket < TIMED_FROM:
        choice = "tl"
    elif choice is None:
        # timed as their plans (the `tl` kernels' first run tunes their tiles, so their time is the tuned one)
        times = timed({"tl": lambda: functools.partial(tl_backward(), *call),
                       **{t: lambda t=t: functools.partial(hopper_backward(t).again, *call) for t in tiles}})
        choice = min(times, key=times.get)
        _keep(key, choice)
        if tuning_log is not None:
            tuning_log.append(dict(kernel="bwd", key=key, times_ms=times))
    best_backward[key] = None if choice == "tl" else choice
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
        if not isinstance(key, BackwardKey):  # a key with §15's terms (backward_choice)
            continue
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
