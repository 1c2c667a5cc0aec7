"""FlashAttention-2 in Triton, written from the derivation in docs/flash_attention.md (§N below
points to its sections).

Kernels, in the order a training step runs them:
  _attn_fwd        a program per (query tile, batch*head): O and each row's log-sum-exp (§3, §4)
  _attn_bwd_dq     a program per (query tile, batch*head): dQ, and Delta = rowsum(dO * O) for
                   its rows (§5)
  _attn_bwd_dkdv   a program per (key tile, batch*kv_head): dK, dV summed over the query heads
                   of its group (§5, §7); reads the Delta the dQ kernel wrote
On Hopper the forward's tuner also times the warp-specialized forward of triton_hopper.py (§12), and
the backward's the warp-specialized backward of triton_hopper_backward.py (§13), keeping the faster
per shape.
No atomics in these kernels: each output element is written by exactly one program, in a fixed
order, so their gradients are bit-identical from run to run. The Hopper backward adds dQ up with
atomics; it steps aside under torch.use_deterministic_algorithms(True).

Shape comments: M = BLOCK_M query rows, N = BLOCK_N key rows, D = BLOCK_D, the head dim padded to
a power of two (columns >= HEAD_DIM load as 0 and are never stored, so nothing is copied).
"""
import functools
import os
import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import triton_hopper, triton_hopper_backward
from .launch import Launched, launch, remember

# Triton decides when a kernel is defined (this import) whether it runs compiled on the GPU or in
# its numpy interpreter on the CPU; the op's device check reads the same flag.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# §9 tensor-descriptor (TMA) loads in the forward: opt-in (docs/perf_notes.md has what they cost and gain)
TMA_MODE = os.environ.get("NANOFLASH_TMA", "0")
# §12, §13 the warp-specialized Hopper forward and backward (triton_hopper.py, triton_hopper_backward.py):
# "auto" times them against the `tl` kernels, "1" takes them without timing wherever they can run, "0" never
HOPPER_MODE = os.environ.get("NANOFLASH_HOPPER", "auto")

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) == exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # log(x) == log2(x) * LN2

# ---------------------------------------------------------------------------------------------
# Autotuning (§9). Tile candidates for Hopper (H100/H200), by head dim padded to a power of two,
# as (BLOCK_M, BLOCK_N, num_warps, num_stages); the first is the default when tuning is off.
# BLOCK_M always counts query rows and BLOCK_N key rows. Larger heads leave room for fewer rows.
# The lists serve dense and block-sparse calls (§10): long dense rows pick the large tiles, the
# short rows of a window or of documents the small ones (benchmarks/tune_kernels.py --masks).
# ---------------------------------------------------------------------------------------------
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
# Under the interpreter there is nothing to tune: one small tile, unequal in M and N so the
# CPU tests cover tiles that straddle the causal diagonal at different offsets.
INTERPRETER_TILES = {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
# Hopper has 227 KiB of shared memory per block; leave room for Triton's own scratch buffers.
SMEM_BUDGET = 200 * 1024


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
    """The tiles worth timing for one call: its head-dim class's candidates that fit in shared
    memory for this dtype, in table order (2-4 of them, so first-call tuning stays short), and for a
    block-sparse call (§10) that divide the mask's blocks, which the kernels walk tile by tile.
    With NANOFLASH_AUTOTUNE=0 _launch takes the first that fits instead of timing them (quick tests)."""
    tiles = [INTERPRETER_TILES[kernel]] if INTERPRET else HOPPER_TILES[kernel][head_dim_class(block_d)]
    kept = [tile for tile in tiles if smem_bytes(kernel, tile, block_d, elem_bytes) <= SMEM_BUDGET
            and (mask_block is None or mask_block % tile[0] == 0 and mask_block % tile[1] == 0)]
    if not kept:
        raise ValueError(f"a block mask with block_size={mask_block} is smaller than every {kernel} tile of the "
                         f"kernel for head_dim {block_d}; build the BlockMask with block_size=64 (the default)")
    return kept


class _TuningKey(NamedTuple):
    """A kernel's tuning key (_launch). The sequence lengths are power-of-two buckets, so a new T reuses the choice
    of its bucket instead of timing the candidates again."""
    kernel: str
    constants: tuple  # the constexprs' (name, value) pairs
    loads: tuple | None
    hopper: bool  # whether §12's kernel was a candidate
    dtype: torch.dtype
    Tq_bucket: int
    Tk_bucket: int


class _BackwardKey(NamedTuple):
    """The key of the backward's choice on Hopper (_backward_choice): the sizes, as _TuningKey buckets them, and the
    Hopper kernel's candidate tiles (its staged ones only where TMA can write the gradients)."""
    head_dim: int
    causal: bool
    dtype: torch.dtype
    Tq_bucket: int
    Tk_bucket: int
    tiles: tuple


# tuning key -> fastest tile
_best_tile: dict[_TuningKey, tuple] = {}
# a list to append each tuning's timings to (benchmarks/tune_kernels.py reads it), or None
tuning_log: list | None = None


def _launch(kernel: str, jit_fn, grid_of_tile, args, constants: dict, Tq: int, Tk: int, dtype,
            block: int | None = None, loads: tuple[str, ...] | None = None, hopper=None) -> tuple[tuple, Launched]:
    """Launch jit_fn with the fastest tile for this call's key, timing the candidates on first use (§9).
    -> the choice, (tile, variant), and its Launched (attention/launch.py), whose `again` takes jit_fn's
    arguments, or for the Hopper kernel what its launch's `again` takes.
    args: the kernel's arguments, or a function of BLOCK_M giving them (for kernels whose work lists
    are cut in tiles, attention/triton_moba.py). block: a size the tiles must divide (§10, §11).
    loads: the settings of the kernel's TMA switch to time with every tile, "tma" (descriptor loads)
    and "pointers", or only "pointers" where descriptors cannot read the tensors; None for a kernel
    without the switch. hopper: (tiles, launch, call) of the warp-specialized forward (§12) where it can run
    the call, timed beside jit_fn's tiles; launch(tile) runs it and returns its Launched, whose again takes call.

    Not @triton.autotune: that rebuilds its key from every one of the ~45 arguments on each call,
    and with the rest of Triton's launch path it cost more host time than the kernels' GPU time at
    GPT-2's shape on the H200 box (benchmarks/launch_overhead.py); here the key is a small tuple."""
    if loads is not None and "tma" in loads:
        # device-side tensor descriptors live in a scratch buffer the launch allocates; the setting is
        # per thread (a context variable), and autograd runs the backward on a thread of its own
        triton.set_allocator(_scratch_allocator)

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
        """run(choice), then -> a function that launches it again as a plan will (the tuner times that one)"""
        tile, variant = choice
        return functools.partial(run(choice).again, *(hopper[2] if variant == "hopper" else args_of(tile[0])))

    key = _TuningKey(kernel, tuple(constants.items()), loads, hopper is not None, dtype,
                     triton.next_power_of_2(Tq), triton.next_power_of_2(Tk))
    choice = _best_tile.get(key)
    if choice is None:
        # in the caller's order of loads (descriptors first: with tuning off they are the ones taken, where the
        # tensors allow them); the Hopper kernel's tiles last, so tuning off never takes them
        candidates = [(tile, variant) for tile in candidate_tiles(kernel, constants["BLOCK_D"], dtype.itemsize, block)
                      for variant in (loads or [None])]
        candidates += [(tile, "hopper") for tile in (hopper[0] if hopper else [])]
        if os.environ.get("NANOFLASH_AUTOTUNE", "1") == "0" or INTERPRET:
            choice, launched = _first_that_fits(candidates, run)  # launched: this call is done
            _best_tile[key] = choice
            return choice, launched
        times = _timed({choice: functools.partial(repeated, choice) for choice in candidates})
        choice = min(times, key=times.get)
        _best_tile[key] = choice
        launched = run(choice)
        if tuning_log is not None:  # with what the compiler made of the chosen tile
            tuning_log.append(dict(kernel=kernel, constants=constants, Tq=Tq, Tk=Tk, times_ms=times,
                                   registers=launched.compiled.n_regs, spills=launched.compiled.n_spills,
                                   wgmma=launched.compiled.asm["ptx"].count("wgmma.mma_async")))
        return choice, launched
    return choice, run(choice)


# How the tuner times a candidate (docs/perf_notes.md, "the tuner under load" has the measurements):
# - Its launch as a plan will repeat it, not the whole path that compiles it and checks the call: that path's host
#   time is paid once per key, and at small shapes it outlasts the cache flush do_bench puts before each run, so it
#   would be timed as well, ranking launch paths instead of kernels.
# - At the clock it will run at. Under sustained load the H200 holds its power cap by lowering the SM clock, within
#   tens of milliseconds, and lowers it more for kernels that draw more per clock. Timed in short turns, a kernel
#   runs at the clock the one before it left (or, right after its compile, an idle GPU's full clock): the `tl`
#   forward timed 9% faster than it ran under load, the Hopper one 5% slower, and the tuner took the wrong one. So
#   all compile first, the first candidate heats the GPU for HEAT_MS, and each runs WARMUP_MS on its own before
#   do_bench times it for REP_MS.
# - In ROUNDS rounds, the order rotating, its time the median of its rounds. Timed once each in a fixed order, a
#   candidate's time depended on the one before it: at hs=128 non-causal T=1k the tuner took the Hopper forward's
#   128-key tile in 3 of 4 fresh tunings, which ran 4% slower than its 64-key tile in every round of a side-by-side
#   timing (benchmarks/results/2026-11-23-h200-bwd-epilogue/tuner/).
HEAT_MS, WARMUP_MS, REP_MS, ROUNDS = 100, 50, 25, 3


def _timed(first_runs: dict) -> dict:
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


def _scratch_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cpu" if INTERPRET else "cuda")


def _first_that_fits(candidates: list[tuple], run) -> tuple[tuple, Launched]:
    """Launch the first candidate that compiles within the GPU's shared memory (tuning off);
    -> that candidate and its launch. The last candidate's error, if it fails too, is the caller's."""
    for choice in candidates[:-1]:
        try:
            return choice, run(choice)
        except OutOfResources:
            continue
    return candidates[-1], run(candidates[-1])


# ---------------------------------------------------------------------------------------------
# Small pieces shared by every kernel
# ---------------------------------------------------------------------------------------------
@triton.jit
def _head_base(ptr, b, h, stride_b, stride_h):
    # 64-bit: b * stride_b passes 2**31 for large batches of long sequences
    return ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def _load_rows(base, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """(len(rows), D) tile of one head's (n_rows, HEAD_DIM) matrix. Padding columns read 0; rows
    past n_rows read 0 only with CHECK_ROWS, which tiles known to lie inside the sequence skip."""
    ptrs = base + rows[:, None] * stride_t + cols[None, :] * stride_d
    mask = cols[None, :] < HEAD_DIM
    if CHECK_ROWS:
        mask = mask & (rows[:, None] < n_rows)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_rows(base, tile, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM: tl.constexpr):
    ptrs = base + rows[:, None] * stride_t + cols[None, :] * stride_d
    mask = (rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM)
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _head_rows(ptr, b, h, stride_b, stride_h, stride_t, n_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK: tl.constexpr, TMA: tl.constexpr):
    """One head's (n_rows, HEAD_DIM) matrix as the tile loads read it (§9 TMA): a pointer to its first
    element, or with TMA a tensor descriptor whose loads are (BLOCK, BLOCK_D) copies done by Hopper's
    tensor memory accelerator: one instruction per tile instead of an address per element, no
    registers spent on addresses and masks, rows past n_rows and columns past HEAD_DIM read as 0."""
    base = _head_base(ptr, b, h, stride_b, stride_h)
    if TMA:
        return tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride_t, 1],
                                         block_shape=[BLOCK, BLOCK_D])
    else:
        return base


@triton.jit
def _load_tile(src, start, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """The (len(rows), D) tile whose rows are start, start + 1, ...: from a descriptor (_head_rows) or,
    for a pointer, as _load_rows."""
    if isinstance(src, tl.tensor_descriptor):
        return src.load([start, 0])
    else:
        return _load_rows(src, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM, CHECK_ROWS)


@triton.jit
def _store_tile(dst, tile, start, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM: tl.constexpr):
    if isinstance(dst, tl.tensor_descriptor):
        dst.store([start, 0], tile.to(dst.dtype))  # rows past n_rows are not written
    else:
        _store_rows(dst, tile, rows, n_rows, stride_t, cols, stride_d, HEAD_DIM)


@triton.jit
def _visible(q_pos, k_pos, Tq, Tk, window_left, window_right, q_doc, k_doc, TILE_BITS, tile_id,
             CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, BITS: tl.constexpr,
             MASK_BLOCK: tl.constexpr):
    """True where query q_pos may attend to key k_pos (broadcast shapes, e.g. (M, 1) and (1, N)).
    Only tiles that need a mask call this: the AND of every rule the call uses (§6, §10). It runs on
    every score of a masked tile, so each rule costs as few integer ops per score as it can.
    Positions are bottom-right aligned: query i sits at absolute position i + Tk - Tq.
    q_doc, k_doc: the rows' document ids (_document_ids), shaped like q_pos and k_pos; None without DOCS."""
    q_abs = q_pos + (Tk - Tq)
    if CAUSAL:  # not in the query's future (for a real query, q_abs <= Tk - 1: so the key exists)
        mask = k_pos <= q_abs
    else:
        mask = k_pos < Tk  # the key exists
    if WINDOW:
        # §10 the window bounds how far the key lies behind the query: lo <= q_abs - k_pos <= window_left,
        # lo = -window_right (0 with causal). Read as unsigned, a distance below lo wraps around past
        # window_left - lo, so one subtraction and one compare per score test both ends (q_abs - lo
        # is per row) instead of two compares and an AND
        if CAUSAL:
            lo = 0
        else:
            lo = -window_right
        in_window = ((q_abs - lo) - k_pos).to(tl.uint32, bitcast=True) <= (window_left - lo).to(tl.uint32, bitcast=True)
        if CAUSAL:
            mask = in_window  # lo = 0 holds the causal rule
        else:
            mask = mask & in_window
    if DOCS:  # §10 documents: the same document
        mask = mask & (q_doc == k_doc)
    if BITS:  # §10 a mask function's partial block, evaluated once on the host: (MASK_BLOCK, MASK_BLOCK) bytes
        offset = tile_id.to(tl.int64) * MASK_BLOCK * MASK_BLOCK + (q_pos % MASK_BLOCK) * MASK_BLOCK + k_pos % MASK_BLOCK
        # tile_id -1 (the mask function sees this whole block; another rule made it partial) gives
        # offsets in [-MASK_BLOCK**2, 0): nothing to load, every pair visible
        mask = mask & (tl.load(TILE_BITS + offset, mask=offset >= 0, other=1) != 0)
    return mask


@triton.jit
def _causal_visible(q_pos, k_pos, Tq, Tk, CAUSAL: tl.constexpr):
    """_visible for dense attention: the causal rule (if any) and the end of the keys."""
    return _visible(q_pos, k_pos, Tq, Tk, 0, 0, None, None, None, -1, CAUSAL, False, False, False, 16)


@triton.jit
def _document_ids(DOC_IDS, pos, shift, n_rows, missing, DOCS: tl.constexpr):
    """§10: the document id at position pos + shift for rows pos < n_rows, `missing` for the others
    (-1 for queries, -2 for keys, so a missing row matches nothing). DOC_IDS points at this batch
    row's ids. A program loads its own rows' ids once, not once per tile; None without DOCS."""
    ids = None
    if DOCS:
        ids = tl.load(DOC_IDS + pos + shift, mask=(pos < n_rows) & (pos + shift >= 0), other=missing)
    return ids


@triton.jit
def _key_ranges(start_m, Tq, Tk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys a query tile [start_m, start_m + BLOCK_M) visits, as two ranges (§6 tile skipping):
    [0, full_end) are visible to every row (no mask), [full_end, end) need the mask."""
    if CAUSAL:
        # query i sees keys <= i + Tk - Tq: the tile's first row bounds the full tiles, its last
        # row the end; key tiles past the end are never loaded
        first_row_last_key = start_m + Tk - Tq
        full_end = tl.maximum(first_row_last_key + 1, 0) // BLOCK_N * BLOCK_N
        end = tl.minimum(first_row_last_key + BLOCK_M, Tk)
    else:
        full_end = Tk // BLOCK_N * BLOCK_N  # only a ragged last tile needs the mask
        end = Tk
    return full_end, end


@triton.jit
def _query_ranges(start_n, Tq, Tk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Queries that see a key tile [start_n, start_n + BLOCK_N), as three ranges (§6): [lo, diag_end)
    straddle the diagonal (mask), [diag_end, full_end) see the whole tile (no mask), [full_end, Tq)
    is the ragged last query tile (mask). Query tiles before lo see none of these keys: skipped."""
    if CAUSAL:
        first_query = start_n - (Tk - Tq)  # first query that sees key start_n
        lo = tl.maximum(first_query, 0) // BLOCK_M * BLOCK_M
        # a query tile starting at or after the query that sees the tile's last key sees it all
        diag_end = tl.cdiv(tl.maximum(first_query + BLOCK_N - 1, 0), BLOCK_M) * BLOCK_M
        diag_end = tl.minimum(diag_end, Tq)
    else:
        lo = 0
        diag_end = 0
    full_end = tl.maximum(diag_end, Tq // BLOCK_M * BLOCK_M)
    return lo, diag_end, full_end


@triton.jit
def _listed_row(BLOCKS, b, h, stride_b, stride_h, start, n_blocks, MASK_BLOCK: tl.constexpr, TILE: tl.constexpr):
    """§10: the block-mask row (see _listed_tile) of the block holding position start, for batch row b and
    head h, and how many TILE-wide tiles its FULL blocks and all its listed blocks hold: -> row, n_full, n_listed."""
    row = BLOCKS + b * stride_b + h * stride_h + (start // MASK_BLOCK) * (2 + 2 * n_blocks)
    return row, tl.load(row) * (MASK_BLOCK // TILE), tl.load(row + 1) * (MASK_BLOCK // TILE)


@triton.jit
def _listed_tile(row, i, MASK_BLOCK: tl.constexpr, TILE: tl.constexpr):
    """§10: the first position of the i-th tile of the blocks a block-mask row lists (row = [n_full,
    n_listed, blocks..., tile ids...], see attention/block_mask.py), counting TILE-wide tiles: each
    block holds MASK_BLOCK // TILE of them. One flat loop over tiles (not a loop per block) lets
    Triton's software pipelining prefetch across block boundaries."""
    TILES_PER_BLOCK: tl.constexpr = MASK_BLOCK // TILE
    return tl.load(row + 2 + i // TILES_PER_BLOCK) * MASK_BLOCK + (i % TILES_PER_BLOCK) * TILE


@triton.jit
def _listed_tile_id(row, i, n_blocks, BITS: tl.constexpr, MASK_BLOCK: tl.constexpr, TILE: tl.constexpr):
    """The stored-mask tile id of the block holding listed tile i (-1 without a mask function)."""
    tile_id = -1
    if BITS:
        tile_id = tl.load(row + 2 + n_blocks + i // (MASK_BLOCK // TILE))
    return tile_id


# ---------------------------------------------------------------------------------------------
# Forward (§2 online softmax, §3 tiling, §4 log-sum-exp)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _query_tile_start(BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """This program's first query row (§9 work order). Causal rows get longer down the sequence and
    the GPU starts programs in launch order, so the first programs take the last (longest) tiles:
    the short ones then fill the gaps at the end instead of a few long ones running on alone."""
    tile = tl.program_id(0)
    if CAUSAL:
        tile = tl.num_programs(0) - 1 - tile
    return tile * BLOCK_M


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, K, V, start_n, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols, Tk, qk_scale,
              visible, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold the key tile k_pos = start_n, start_n + 1, ... (N,) into one query tile's running max m_i,
    running sum l_i and unnormalised output acc. visible: the (M, N) mask of a tile that needs one;
    None for a tile every row sees whole (then no mask is built and no load is bounds-checked)."""
    k = _load_tile(K, start_n, k_pos, Tk, stride_kt, cols, stride_kd, HEAD_DIM, visible is not None)  # (N, D)
    v = _load_tile(V, start_n, k_pos, Tk, stride_vt, cols, stride_vd, HEAD_DIM, visible is not None)  # (N, D)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (M, N), fp32 sums
    if visible is not None:
        qk = tl.where(visible, qk, float("-inf"))
    # §2 online softmax: move the running max, rescale what was summed under the old one.
    # §8 exp2: scores in base 2, s = q.k * scale * log2(e); the max commutes with that positive
    # factor, so scaling the row max and then qk * qk_scale - m is one fused multiply-add
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # (M,)
    m_ref = m_new
    if visible is not None:
        # §8 fully-masked rows: a row that has seen no key keeps m = -inf; subtracting 0
        # instead keeps exp2(-inf - -inf) = NaN out of p and alpha (both become 0)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk * qk_scale - m_ref[:, None])  # (M, N)
    alpha = tl.exp2(m_i - m_ref)  # (M,)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # (M, D)
    return acc, m_new, l_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE,
              stride_qb, stride_qh, stride_qt, stride_qd,
              stride_kb, stride_kh, stride_kt, stride_kd,
              stride_vb, stride_vh, stride_vt, stride_vd,
              stride_ob, stride_oh, stride_ot, stride_od,
              H, GROUP, Tq, Tk, scale,
              BLOCKS, stride_blocks_b, stride_blocks_h, n_blocks,
              window_left, window_right, DOC_IDS, stride_doc_b, TILE_BITS,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
              SPARSE: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, BITS: tl.constexpr,
              MASK_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    start_m = _query_tile_start(BLOCK_M, CAUSAL)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    # §7 GQA: query head h reads kv head h // GROUP, GROUP = Hq // Hkv
    Q = _head_rows(Q, b, h, stride_qb, stride_qh, stride_qt, Tq, HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
    K = _head_rows(K, b, h // GROUP, stride_kb, stride_kh, stride_kt, Tk, HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
    V = _head_rows(V, b, h // GROUP, stride_vb, stride_vh, stride_vt, Tk, HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
    O = _head_rows(O, b, h, stride_ob, stride_oh, stride_ot, Tq, HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
    if DOCS:
        DOC_IDS += b.to(tl.int64) * stride_doc_b  # this batch row's document ids

    q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
    cols = tl.arange(0, BLOCK_D)  # (D,)
    q = _load_tile(Q, start_m, q_pos, Tq, stride_qt, cols, stride_qd, HEAD_DIM, True)  # (M, D), on chip throughout
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E

    if SPARSE:
        # §10 block-sparse: the key blocks the block mask lists for this query block, the FULL ones
        # unmasked, then the PARTIAL ones masked; SKIP blocks are never loaded
        row, n_full, n_listed = _listed_row(BLOCKS, b, h, stride_blocks_b, stride_blocks_h, start_m, n_blocks,
                                            MASK_BLOCK, BLOCK_N)
        for i in range(n_full):
            start_n = _listed_tile(row, i, MASK_BLOCK, BLOCK_N)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, start_n, start_n + tl.arange(0, BLOCK_N), stride_kt,
                                      stride_kd, stride_vt, stride_vd, cols, Tk, qk_scale, None, HEAD_DIM, DOT_PRECISION)
        q_doc = _document_ids(DOC_IDS, q_pos[:, None], Tk - Tq, Tq, -1, DOCS)  # (M, 1)
        for i in range(n_full, n_listed):
            start_n = _listed_tile(row, i, MASK_BLOCK, BLOCK_N)
            tile_id = _listed_tile_id(row, i, n_blocks, BITS, MASK_BLOCK, BLOCK_N)
            k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
            k_doc = _document_ids(DOC_IDS, k_pos[None, :], 0, Tk, -2, DOCS)  # (1, N)
            visible = _visible(q_pos[:, None], k_pos[None, :], Tq, Tk, window_left, window_right, q_doc, k_doc,
                               TILE_BITS, tile_id, CAUSAL, WINDOW, DOCS, BITS, MASK_BLOCK)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, start_n, k_pos, stride_kt, stride_kd, stride_vt,
                                      stride_vd, cols, Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION)
    else:
        # §6: the fully visible key tiles first, unmasked; then the few that need the mask
        full_end, end = _key_ranges(start_m, Tq, Tk, BLOCK_M, BLOCK_N, CAUSAL)
        for start_n in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, start_n, start_n + tl.arange(0, BLOCK_N), stride_kt,
                                      stride_kd, stride_vt, stride_vd, cols, Tk, qk_scale, None, HEAD_DIM, DOT_PRECISION)
        for start_n in range(full_end, end, BLOCK_N):
            k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
            visible = _causal_visible(q_pos[:, None], k_pos[None, :], Tq, Tk, CAUSAL)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, start_n, k_pos, stride_kt, stride_kd, stride_vt,
                                      stride_vd, cols, Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION)

    # §4 log-sum-exp, saved for the backward pass, in natural log: lse = (m + log2 l) * ln 2.
    # §8 fully-masked rows: l = 0 -> output 0 and lse = +inf, so backward's exp2(s - lse) is 0
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("inf"))
    _store_tile(O, acc / l_safe[:, None], start_m, q_pos, Tq, stride_ot, cols, stride_od, HEAD_DIM)
    tl.store(LSE + bh.to(tl.int64) * Tq + q_pos, lse, mask=q_pos < Tq)


# ---------------------------------------------------------------------------------------------
# Backward (§5): dV = P^T dO, dP = dO V^T, dS = P * (dP - Delta), dQ = scale dS K, dK = scale dS^T Q
# with P recomputed tile by tile from the saved log-sum-exp.
# ---------------------------------------------------------------------------------------------
@triton.jit
def _dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, q_pos, stride_qt, stride_qd, stride_dot, stride_dod, cols, Tq,
               qk_scale, visibleT, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the query tile q_pos (M,) of one head into a key tile's dK, dV. Computed transposed (keys
    as rows) so P^T and dS^T come out of tl.dot in the layout the next dot consumes. visibleT: the
    (N, M) mask, or None for a tile that needs none."""
    q = _load_rows(Q, q_pos, Tq, stride_qt, cols, stride_qd, HEAD_DIM, visibleT is not None)  # (M, D)
    do = _load_rows(DO, q_pos, Tq, stride_dot, cols, stride_dod, HEAD_DIM, visibleT is not None)  # (M, D)
    # rows past Tq load lse = +inf, which makes their P (and so dS) exactly 0
    lse2 = tl.load(LSE + q_pos, mask=q_pos < Tq, other=float("inf")) * LOG2E  # (M,), base 2
    delta = tl.load(DELTA + q_pos, mask=q_pos < Tq, other=0.0)  # (M,)
    # §4: recompute P^T = exp2(s - lse) instead of having stored the (Tq, Tk) matrix
    pT = tl.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse2[None, :])  # (N, M)
    if visibleT is not None:
        pT = tl.where(visibleT, pT, 0.0)
    dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # dV += P^T dO   (N, D)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # dP^T = V dO^T        (N, M)
    dsT = pT * (dpT - delta[None, :])  # §5 softmax Jacobian: dS = P * (dP - Delta)       (N, M)
    dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)  # dK += dS^T Q  (N, D)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA,
                   stride_qb, stride_qh, stride_qt, stride_qd,
                   stride_kb, stride_kh, stride_kt, stride_kd,
                   stride_vb, stride_vh, stride_vt, stride_vd,
                   stride_dob, stride_doh, stride_dot, stride_dod,
                   stride_dkb, stride_dkh, stride_dkt, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvt, stride_dvd,
                   H, GROUP, Tq, Tk, scale,
                   BLOCKS, stride_blocks_b, stride_blocks_h, n_blocks,
                   window_left, window_right, DOC_IDS, stride_doc_b, TILE_BITS,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                   SPARSE: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, BITS: tl.constexpr,
                   MASK_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh_kv = tl.program_id(1)
    H_kv = H // GROUP
    b, h_kv = bh_kv // H_kv, bh_kv % H_kv
    if DOCS:
        DOC_IDS += b.to(tl.int64) * stride_doc_b  # this batch row's document ids

    k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
    k_doc = _document_ids(DOC_IDS, k_pos[:, None], 0, Tk, -2, DOCS)  # (N, 1)
    cols = tl.arange(0, BLOCK_D)  # (D,)
    k = _load_rows(_head_base(K, b, h_kv, stride_kb, stride_kh), k_pos, Tk, stride_kt, cols, stride_kd,
                   HEAD_DIM, True)  # (N, D), on chip throughout
    v = _load_rows(_head_base(V, b, h_kv, stride_vb, stride_vh), k_pos, Tk, stride_vt, cols, stride_vd,
                   HEAD_DIM, True)  # (N, D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E

    # §7 GQA gradient sum: every query head that reads this kv head adds into the same registers,
    # one head after the other, so no two programs write the same dK/dV rows (no atomics)
    for g in range(GROUP):
        h = h_kv * GROUP + g
        Qh = _head_base(Q, b, h, stride_qb, stride_qh)
        DOh = _head_base(DO, b, h, stride_dob, stride_doh)
        LSEh = LSE + (b * H + h).to(tl.int64) * Tq
        DELTAh = DELTA + (b * H + h).to(tl.int64) * Tq
        if SPARSE:
            # §10: the query blocks the block mask lists for this key block (and head), FULL then PARTIAL
            row, n_full, n_listed = _listed_row(BLOCKS, b, h, stride_blocks_b, stride_blocks_h, start_n, n_blocks,
                                                MASK_BLOCK, BLOCK_M)
            for i in range(n_full):
                start_m = _listed_tile(row, i, MASK_BLOCK, BLOCK_M)
                dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, start_m + tl.arange(0, BLOCK_M), stride_qt,
                                    stride_qd, stride_dot, stride_dod, cols, Tq, qk_scale, None, HEAD_DIM, DOT_PRECISION)
            for i in range(n_full, n_listed):
                start_m = _listed_tile(row, i, MASK_BLOCK, BLOCK_M)
                tile_id = _listed_tile_id(row, i, n_blocks, BITS, MASK_BLOCK, BLOCK_M)
                q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
                q_doc = _document_ids(DOC_IDS, q_pos[None, :], Tk - Tq, Tq, -1, DOCS)  # (1, M)
                visibleT = _visible(q_pos[None, :], k_pos[:, None], Tq, Tk, window_left, window_right, q_doc, k_doc,
                                    TILE_BITS, tile_id, CAUSAL, WINDOW, DOCS, BITS, MASK_BLOCK)
                dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, q_pos, stride_qt, stride_qd, stride_dot,
                                    stride_dod, cols, Tq, qk_scale, visibleT, HEAD_DIM, DOT_PRECISION)
        else:
            # §6: query tiles on the diagonal masked, fully visible ones not, the ragged last one masked
            lo, diag_end, full_end = _query_ranges(start_n, Tq, Tk, BLOCK_M, BLOCK_N, CAUSAL)
            for start_m in range(lo, diag_end, BLOCK_M):
                q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
                visibleT = _causal_visible(q_pos[None, :], k_pos[:, None], Tq, Tk, CAUSAL)
                dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, q_pos, stride_qt, stride_qd, stride_dot,
                                    stride_dod, cols, Tq, qk_scale, visibleT, HEAD_DIM, DOT_PRECISION)
            for start_m in range(diag_end, full_end, BLOCK_M):
                dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, start_m + tl.arange(0, BLOCK_M), stride_qt,
                                    stride_qd, stride_dot, stride_dod, cols, Tq, qk_scale, None, HEAD_DIM, DOT_PRECISION)
            for start_m in range(full_end, Tq, BLOCK_M):
                q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
                visibleT = _causal_visible(q_pos[None, :], k_pos[:, None], Tq, Tk, CAUSAL)
                dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, q_pos, stride_qt, stride_qd, stride_dot,
                                    stride_dod, cols, Tq, qk_scale, visibleT, HEAD_DIM, DOT_PRECISION)

    DK = _head_base(DK, b, h_kv, stride_dkb, stride_dkh)
    DV = _head_base(DV, b, h_kv, stride_dvb, stride_dvh)
    _store_rows(DK, dk * scale, k_pos, Tk, stride_dkt, cols, stride_dkd, HEAD_DIM)  # dS was w.r.t. scale * QK^T
    _store_rows(DV, dv, k_pos, Tk, stride_dvt, cols, stride_dvd, HEAD_DIM)


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, K, V, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols, Tk, qk_scale,
             visible, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the key tile k_pos (N,) into one query tile's dQ; visible as in _fwd_tile."""
    k = _load_rows(K, k_pos, Tk, stride_kt, cols, stride_kd, HEAD_DIM, visible is not None)  # (N, D)
    v = _load_rows(V, k_pos, Tk, stride_vt, cols, stride_vd, HEAD_DIM, visible is not None)  # (N, D)
    p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])  # (M, N)
    if visible is not None:
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (M, N)
    ds = p * (dp - delta[:, None])  # §5 (M, N)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)  # dQ += dS K  (M, D)


@triton.jit
def _attn_bwd_dq(Q, K, V, O, DO, DQ, LSE, DELTA,
                 stride_qb, stride_qh, stride_qt, stride_qd,
                 stride_kb, stride_kh, stride_kt, stride_kd,
                 stride_vb, stride_vh, stride_vt, stride_vd,
                 stride_ob, stride_oh, stride_ot, stride_od,
                 stride_dob, stride_doh, stride_dot, stride_dod,
                 stride_dqb, stride_dqh, stride_dqt, stride_dqd,
                 H, GROUP, Tq, Tk, scale,
                 BLOCKS, stride_blocks_b, stride_blocks_h, n_blocks,
                 window_left, window_right, DOC_IDS, stride_doc_b, TILE_BITS,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                 SPARSE: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, BITS: tl.constexpr,
                 MASK_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = _query_tile_start(BLOCK_M, CAUSAL)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    K = _head_base(K, b, h // GROUP, stride_kb, stride_kh)  # §7
    V = _head_base(V, b, h // GROUP, stride_vb, stride_vh)
    if DOCS:
        DOC_IDS += b.to(tl.int64) * stride_doc_b  # this batch row's document ids

    q_pos = start_m + tl.arange(0, BLOCK_M)  # (M,)
    cols = tl.arange(0, BLOCK_D)  # (D,)
    q = _load_rows(_head_base(Q, b, h, stride_qb, stride_qh), q_pos, Tq, stride_qt, cols, stride_qd,
                   HEAD_DIM, True)  # (M, D), on chip throughout, like dO, lse and Delta
    do = _load_rows(_head_base(DO, b, h, stride_dob, stride_doh), q_pos, Tq, stride_dot, cols, stride_dod,
                    HEAD_DIM, True)  # (M, D)
    lse2 = tl.load(LSE + bh.to(tl.int64) * Tq + q_pos, mask=q_pos < Tq, other=float("inf")) * LOG2E  # (M,)
    # §5 Delta_i = sum_j P_ij dP_ij = rowsum(dO * O)_i: one D-long dot product per row. This kernel
    # holds the rows' dO anyway, so it computes Delta here and stores it for the dK/dV kernel,
    # which runs next (a separate pre-pass would cost a launch and a second read of dO).
    o = _load_rows(_head_base(O, b, h, stride_ob, stride_oh), q_pos, Tq, stride_ot, cols, stride_od,
                   HEAD_DIM, True)  # (M, D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (M,)
    tl.store(DELTA + bh.to(tl.int64) * Tq + q_pos, delta, mask=q_pos < Tq)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E

    if SPARSE:  # §10, the same key blocks as the forward pass visited
        row, n_full, n_listed = _listed_row(BLOCKS, b, h, stride_blocks_b, stride_blocks_h, start_m, n_blocks,
                                            MASK_BLOCK, BLOCK_N)
        for i in range(n_full):
            start_n = _listed_tile(row, i, MASK_BLOCK, BLOCK_N)
            dq = _dq_tile(dq, q, do, lse2, delta, K, V, start_n + tl.arange(0, BLOCK_N), stride_kt, stride_kd,
                          stride_vt, stride_vd, cols, Tk, qk_scale, None, HEAD_DIM, DOT_PRECISION)
        q_doc = _document_ids(DOC_IDS, q_pos[:, None], Tk - Tq, Tq, -1, DOCS)  # (M, 1)
        for i in range(n_full, n_listed):
            start_n = _listed_tile(row, i, MASK_BLOCK, BLOCK_N)
            tile_id = _listed_tile_id(row, i, n_blocks, BITS, MASK_BLOCK, BLOCK_N)
            k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
            k_doc = _document_ids(DOC_IDS, k_pos[None, :], 0, Tk, -2, DOCS)  # (1, N)
            visible = _visible(q_pos[:, None], k_pos[None, :], Tq, Tk, window_left, window_right, q_doc, k_doc,
                               TILE_BITS, tile_id, CAUSAL, WINDOW, DOCS, BITS, MASK_BLOCK)
            dq = _dq_tile(dq, q, do, lse2, delta, K, V, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols,
                          Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION)
    else:
        full_end, end = _key_ranges(start_m, Tq, Tk, BLOCK_M, BLOCK_N, CAUSAL)  # §6, as in the forward
        for start_n in range(0, full_end, BLOCK_N):
            dq = _dq_tile(dq, q, do, lse2, delta, K, V, start_n + tl.arange(0, BLOCK_N), stride_kt, stride_kd,
                          stride_vt, stride_vd, cols, Tk, qk_scale, None, HEAD_DIM, DOT_PRECISION)
        for start_n in range(full_end, end, BLOCK_N):
            k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
            visible = _causal_visible(q_pos[:, None], k_pos[None, :], Tq, Tk, CAUSAL)
            dq = _dq_tile(dq, q, do, lse2, delta, K, V, k_pos, stride_kt, stride_kd, stride_vt, stride_vd, cols,
                          Tk, qk_scale, visible, HEAD_DIM, DOT_PRECISION)
    DQ = _head_base(DQ, b, h, stride_dqb, stride_dqh)
    _store_rows(DQ, dq * scale, q_pos, Tq, stride_dqt, cols, stride_dqd, HEAD_DIM)


# ---------------------------------------------------------------------------------------------
# Launchers: q (B, Hq, Tq, D), k and v (B, Hkv, Tk, D), any strides
# ---------------------------------------------------------------------------------------------
def empty_bthd(B: int, H: int, T: int, D: int, like: torch.Tensor) -> torch.Tensor:
    """Uninitialised (B, H, T, D) stored as (B, T, H, D): the model's y.transpose(1, 2) of it is
    contiguous, so merging the heads back into (B, T, C) costs no copy (and likewise for grads). One call: an eager
    backward allocates three of these, and each torch call is host time there (docs/perf_notes.md, "GPT-2's eager
    cell, span by span")."""
    return torch.empty_strided((B, H, T, D), (T * H * D, D, H * D, 1), dtype=like.dtype, device=like.device)


def _constants(q: torch.Tensor, causal: bool, mask: "MaskArgs") -> dict:
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
    )


@functools.cache
def _hopper_or_newer(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _use_tma(*tensors: torch.Tensor) -> bool:
    """§9: with NANOFLASH_TMA=1, the forward may load tiles through tensor descriptors (TMA) where the
    GPU has the copy engine (Hopper and newer; the interpreter runs them too, for the CPU tests) and
    every tensor fits its rules: unit stride along the head dim, every other stride and the start
    16-byte aligned. Other layouts take the pointer loads, which read any strides."""
    if TMA_MODE != "1" or not (INTERPRET or _hopper_or_newer(tensors[0].device)):
        return False
    return triton_hopper.tma_can_read(*tensors)


class MaskArgs(NamedTuple):
    """A block-sparse call's mask as plain tensors and numbers (§10); all None for dense attention.
    attention/block_mask.py builds them; the PyTorch op (triton_op.py) passes them through."""
    kv_blocks: torch.Tensor | None = None  # (Bm, Hm, n_q_blocks, 2 + 2 n_kv_blocks) int32, forward and dQ
    q_blocks: torch.Tensor | None = None  # (Bm, Hm, n_kv_blocks, 2 + 2 n_q_blocks) int32, dK/dV
    window: tuple[int, int] | None = None  # (left, right), -1 = unbounded
    document_ids: torch.Tensor | None = None  # (B, Tk) integer
    tile_bits: torch.Tensor | None = None  # (n_tiles, block, block) uint8
    block_size: int = 16  # unused when dense


DENSE = MaskArgs()


def _tiles_divide(mask: MaskArgs) -> int | None:
    return mask.block_size if mask.kv_blocks is not None else None  # a sparse call's tiles walk its blocks


def _mask_args(mask: MaskArgs, lists: torch.Tensor | None, Tk: int) -> tuple:
    """The kernels' mask arguments (BLOCKS ... TILE_BITS) for one block list (kv or q direction)."""
    if lists is None:
        return (None, 0, 0, 0, 0, 0, None, 0, None)
    Bm, Hm, rows, row_len = lists.shape
    # size-1 (broadcast) batch/head dims of the mask get stride 0: every batch row / head reads the same lists
    stride_b = Hm * rows * row_len if Bm > 1 else 0
    stride_h = rows * row_len if Hm > 1 else 0
    left, right = mask.window or (-1, -1)
    unbounded = 2 * Tk  # -1: farther than any key can be
    docs = mask.document_ids
    return (lists, stride_b, stride_h, (row_len - 2) // 2, unbounded if left < 0 else left,
            unbounded if right < 0 else right, docs, docs.stride(0) if docs is not None else 0, mask.tile_bits)


# Launch plans. A call whose mask holds no tensors (dense attention) launches the same way as another of the same
# shapes, strides, dtypes, 16-byte alignment and device, with the settings in _plan_key: its plan key. The first call
# of a key takes the whole path (the kernels' eligibility checks, the tuner, attention/launch.py's keys over every
# argument) and leaves a plan, again(the call's tensors, scale): its launches with everything else worked out. Later
# calls of the key run the plan. At GPT-2's shape the whole path cost more host time than the kernels' GPU time
# (docs/perf_notes.md, "launch plans").
_plans: dict[tuple, Callable] = {}


def _plan_key(kind: str, causal: bool, mask: MaskArgs, *tensors: torch.Tensor) -> tuple | None:
    """-> the call's plan key; None for a block-sparse call (§10), whose mask tensors change from call to call."""
    if any(t is not None for t in (mask.kv_blocks, mask.q_blocks, mask.document_ids, mask.tile_bits)):
        return None
    return (kind, causal, mask.window, mask.block_size, HOPPER_MODE, TMA_MODE,
            torch.are_deterministic_algorithms_enabled(), tensors[0].device,
            *[(t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0) for t in tensors])


def _planned(key: tuple | None, whole_path: Callable, *call) -> None:
    """Run the plan kept under key on call, or whole_path(), which launches the call and returns its plan."""
    again = None if key is None else _plans.get(key)
    if again is not None:
        again(*call)
        return
    again = whole_path()
    if key is not None:
        remember(_plans, key, again)


def forward(q, k, v, causal: bool, scale: float, mask: MaskArgs = DENSE) -> tuple[torch.Tensor, torch.Tensor]:
    """-> out (B, Hq, Tq, D) in q's dtype, lse (B, Hq, Tq) float32 (natural log; +inf for rows
    that see no key)."""
    B, Hq, Tq, D = q.shape
    o = empty_bthd(B, Hq, Tq, D, q)
    lse = torch.empty(B, Hq, Tq, dtype=torch.float32, device=q.device)
    key = _plan_key("fwd", causal, mask, q, k, v)
    _planned(key, lambda: _forward_plan(q, k, v, o, lse, causal, scale, mask), q, k, v, o, lse, scale)
    return o, lse


def _forward_args(q, k, v, o, lse, scale: float, mask: MaskArgs) -> tuple:
    """_attn_fwd's arguments, up to the constexprs."""
    Hq, Tq, Hkv, Tk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    return (q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), Hq, Hq // Hkv, Tq, Tk, scale,
            *_mask_args(mask, mask.kv_blocks, Tk))


def _forward_plan(q, k, v, o, lse, causal: bool, scale: float, mask: MaskArgs) -> Callable:
    """The forward's whole path: launch it; -> its plan, again(q, k, v, o, lse, scale)."""
    B, Hq, Tq, D = q.shape
    Tk = k.shape[2]
    hopper = None
    if HOPPER_MODE != "0" and triton_hopper.supports(q, k, v, dense=mask.kv_blocks is None):
        tiles = triton_hopper.TILES[D]
        if HOPPER_MODE == "1":
            return triton_hopper.forward(q, k, v, o, lse, causal, scale, tiles[0]).again
        hopper = (tiles, lambda tile: triton_hopper.forward(q, k, v, o, lse, causal, scale, tile),
                  (q, k, v, o, lse, scale))
    # §9: the tuner times each tile with descriptor loads and with pointer loads where both can run, and
    # §12 on Hopper the warp-specialized kernel's tiles beside them
    tma = _use_tma(q, k, v, o)
    choice, launched = _launch("fwd", _attn_fwd, lambda block_m, _: (triton.cdiv(Tq, block_m), B * Hq),
                               _forward_args(q, k, v, o, lse, scale, mask), _constants(q, causal, mask), Tq, Tk,
                               q.dtype, _tiles_divide(mask), loads=("tma", "pointers") if tma else ("pointers",),
                               hopper=hopper)
    if choice[1] == "hopper":
        return launched.again

    def again(q, k, v, o, lse, scale):
        if tma:
            triton.set_allocator(_scratch_allocator)  # per thread, as in _launch
        launched.again(*_forward_args(q, k, v, o, lse, scale, mask))
    return again


def backward(do, q, k, v, o, lse, causal: bool, scale: float, mask: MaskArgs = DENSE,
             grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """-> dq, dk, dv, shaped like q, k, v. grads: tensors to write them into (any strides; the slices of
    one packed gradient, see triton_op.py), by default new ones."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    dq, dk, dv = grads or (empty_bthd(B, Hq, Tq, D, q), empty_bthd(B, Hkv, Tk, D, k), empty_bthd(B, Hkv, Tk, D, v))
    key = _plan_key("bwd", causal, mask, do, q, k, v, o, lse, dq, dk, dv)
    _planned(key, lambda: _backward_plan(do, q, k, v, o, lse, dq, dk, dv, causal, scale, mask),
             do, q, k, v, o, lse, dq, dk, dv, scale)
    return dq, dk, dv


def _backward_plan(do, q, k, v, o, lse, dq, dk, dv, causal: bool, scale: float, mask: MaskArgs) -> Callable:
    """The backward's whole path: launch it; -> its plan, again(do, q, k, v, o, lse, dq, dk, dv, scale)."""
    D, Tq, Tk = q.shape[-1], q.shape[2], k.shape[2]
    # §13 on Hopper the warp-specialized backward (five matmuls, dQ added up in L2) competes with the two `tl`
    # kernels below; not where determinism was asked for (torch.use_deterministic_algorithms): its dQ's last bits
    # depend on the order the adds land in
    if (HOPPER_MODE != "0" and not torch.are_deterministic_algorithms_enabled()
            and triton_hopper_backward.supports(q, k, v, o, do, (dq, dk, dv), dense=mask.kv_blocks is None)):
        hopper = functools.partial(triton_hopper_backward.backward, do, q, k, v, o, lse, dq, dk, dv, causal, scale)
        tiles = triton_hopper_backward.tiles(D, dk, dv)
        tile = _backward_choice(lambda: _tl_backward(do, q, k, v, o, lse, dq, dk, dv, causal, scale, mask), hopper,
                                tiles, _BackwardKey(D, causal, q.dtype, triton.next_power_of_2(Tq),
                                                    triton.next_power_of_2(Tk), tuple(tiles)),
                                (do, q, k, v, o, lse, dq, dk, dv, scale))
        if tile is not None:
            return hopper(tile).again
    return _tl_backward(do, q, k, v, o, lse, dq, dk, dv, causal, scale, mask)


# tuning key -> the backward's choice on Hopper: None (the `tl` kernels) or the Hopper kernel's tile
_best_backward: dict[_BackwardKey, tuple | None] = {}


def tuned_choices(head_dim: int, causal: bool, dtype: torch.dtype, Tq: int, Tk: int) -> dict:
    """What the tuner (§9) has chosen so far for dense calls of these sizes, by kernel: "fwd", "dq", "dkdv" ->
    (tile, variant), variant "hopper" being §12's kernel with a (BLOCK_N, K_STAGES, V_STAGES, PERSISTENT, CONSUMERS)
    tile; "bwd" -> None where the `tl` pair (dq, dkdv) runs, or §13's kernel's (STAGES, DKDV_STAGED) tile. Kernels
    not tuned yet are left out; where calls of several layouts were tuned, the last one's. benchmarks/attention.py
    records it per cell."""
    buckets = (triton.next_power_of_2(Tq), triton.next_power_of_2(Tk))
    dense = dict(HEAD_DIM=head_dim, CAUSAL=causal, SPARSE=False, WINDOW=False, DOCS=False, BITS=False)
    found = {}
    for key, choice in _best_tile.items():
        constants = dict(key.constants)
        if ((key.dtype, key.Tq_bucket, key.Tk_bucket) == (dtype, *buckets)
                and all(constants.get(name) == value for name, value in dense.items())):
            found[key.kernel] = choice
    for key, choice in _best_backward.items():
        if (key.head_dim, key.causal, key.dtype, key.Tq_bucket, key.Tk_bucket) == (head_dim, causal, dtype, *buckets):
            found["bwd"] = choice  # whichever candidate tiles
    return found


def _backward_choice(tl_backward, hopper_backward, tiles: list[tuple], key: tuple, call: tuple) -> tuple | None:
    """The backward for key: None for the `tl` kernels (each with its own tuned tile, _launch), or the Hopper
    kernel's tile; on the key's first call the candidates are timed (§9), each run writing the gradients,
    which the caller's run then writes again. tl_backward() -> the `tl` plan; hopper_backward(tile) -> the Hopper
    kernel's Launched; both plans take call."""
    if key not in _best_backward:
        if HOPPER_MODE == "1":
            _best_backward[key] = tiles[0]
        elif os.environ.get("NANOFLASH_AUTOTUNE", "1") == "0":
            _best_backward[key] = None
        else:
            # timed as their plans (the `tl` kernels' first run tunes their tiles, so their time is the tuned one)
            times = _timed({None: lambda: functools.partial(tl_backward(), *call),
                            **{t: lambda t=t: functools.partial(hopper_backward(t).again, *call) for t in tiles}})
            _best_backward[key] = min(times, key=times.get)
            if tuning_log is not None:
                tuning_log.append(dict(kernel="bwd", key=key, times_ms=times))
    return _best_backward[key]


def _tl_backward(do, q, k, v, o, lse, dq, dk, dv, causal: bool, scale: float, mask: MaskArgs) -> Callable:
    """The `tl` backward into dq, dk, dv: the dQ kernel (which also writes Delta), then the dK/dV kernel.
    -> its plan, again(do, q, k, v, o, lse, dq, dk, dv, scale)."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]

    def args(do, q, k, v, o, lse, dq, dk, dv, scale):
        """-> the dQ kernel's arguments and the dK/dV kernel's, up to the constexprs"""
        delta = torch.empty_like(lse)
        seq_args = (Hq, Hq // Hkv, Tq, Tk, scale)
        return ((q, k, v, o, do, dq, lse, delta, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(),
                 *dq.stride(), *seq_args, *_mask_args(mask, mask.kv_blocks, Tk)),
                (q, k, v, do, dk, dv, lse, delta, *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(),
                 *dv.stride(), *seq_args, *_mask_args(mask, mask.q_blocks, Tk)))
    dq_args, dkdv_args = args(do, q, k, v, o, lse, dq, dk, dv, scale)
    constants = _constants(q, causal, mask)
    # dQ first: it also writes Delta (§5), which the dK/dV kernel reads; stream order makes it ready
    _, dq_launched = _launch("dq", _attn_bwd_dq, lambda block_m, _: (triton.cdiv(Tq, block_m), B * Hq), dq_args,
                             constants, Tq, Tk, q.dtype, _tiles_divide(mask))
    _, dkdv_launched = _launch("dkdv", _attn_bwd_dkdv, lambda _, block_n: (triton.cdiv(Tk, block_n), B * Hkv),
                               dkdv_args, constants, Tq, Tk, q.dtype, _tiles_divide(mask))

    def again(*call):
        dq_args, dkdv_args = args(*call)
        dq_launched.again(*dq_args)
        dkdv_launched.again(*dkdv_args)
    return again
