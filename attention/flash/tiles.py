"""The `tl` kernels' tiles (§9): TlTile(block_m, block_n, warps, stages), candidates by head dim, and what a tile
needs of shared memory. The tuner (tuner.py) times a call's candidates; the Hopper kernels' tiles are
hopper/shapes.py's.
"""
from typing import NamedTuple

from .device import INTERPRET


class TlTile(NamedTuple):
    """A `tl` kernel's tile: block_m query rows by block_n key rows, num_warps warps, num_stages loads in flight."""
    block_m: int
    block_n: int
    warps: int
    stages: int


# Candidates by head dim padded to a power of two; the first is the one taken when tuning is off. Larger heads leave
# room for fewer rows. The lists serve dense and block-sparse calls (§10): long dense rows pick the large tiles, the
# short rows of a window or of documents the small ones.
TL_TILES = {
    "fwd": {
        64: [TlTile(128, 64, 8, 3), TlTile(64, 64, 4, 3), TlTile(64, 64, 4, 4), TlTile(128, 64, 4, 3)],
        128: [TlTile(128, 64, 8, 3), TlTile(128, 128, 8, 2), TlTile(64, 64, 4, 3), TlTile(128, 32, 4, 3)],
        256: [TlTile(64, 64, 8, 2), TlTile(64, 64, 4, 2), TlTile(128, 64, 8, 2), TlTile(32, 32, 4, 1)],
    },
    # dK/dV keeps two fp32 (BLOCK_N, D) accumulators: wide heads want more warps to hold them
    "dkdv": {
        64: [TlTile(64, 128, 4, 3), TlTile(32, 128, 4, 3), TlTile(64, 64, 4, 3), TlTile(32, 64, 4, 2)],
        128: [TlTile(64, 128, 8, 3), TlTile(64, 128, 8, 2), TlTile(64, 64, 4, 2), TlTile(32, 64, 4, 2)],
        256: [TlTile(32, 64, 8, 2), TlTile(64, 64, 8, 2), TlTile(32, 32, 4, 1)],
    },
    "dq": {
        64: [TlTile(128, 64, 8, 3), TlTile(64, 64, 4, 3), TlTile(128, 32, 4, 3), TlTile(64, 64, 4, 2)],
        128: [TlTile(128, 64, 8, 3), TlTile(64, 64, 4, 3), TlTile(64, 64, 4, 2), TlTile(64, 32, 4, 2)],
        256: [TlTile(64, 32, 8, 2), TlTile(64, 64, 8, 2), TlTile(32, 32, 4, 1)],
    },
}
# Under the interpreter there is nothing to tune: one small tile, unequal in M and N so the CPU tests cover tiles
# that straddle the causal diagonal at different offsets.
INTERPRETER_TILES = {"fwd": TlTile(32, 16, 4, 1), "dkdv": TlTile(16, 32, 4, 1), "dq": TlTile(32, 16, 4, 1)}
# Hopper has 227 KiB of shared memory per block; leave room for Triton's own scratch buffers.
SMEM_BUDGET = 200 * 1024


def head_dim_class(block_d: int) -> int:
    # heads of 16 and 32 take the 64 tiles: their tiles are small whatever the row counts
    return max(64, block_d)


def smem_bytes(kernel: str, tile: TlTile, block_d: int, elem_bytes: int) -> int:
    """Shared memory a tile config needs: the tiles a program holds plus num_stages copies of the
    tiles it streams (software pipelining keeps that many loads in flight)."""
    block_m, block_n, _, stages = tile
    held, streamed = {
        "fwd": (block_m, 2 * block_n),  # holds Q; streams K, V
        "dq": (2 * block_m, 2 * block_n),  # holds Q, dO; streams K, V
        "dkdv": (2 * block_n, 2 * block_m),  # holds K, V; streams Q, dO
    }[kernel]
    return (held + stages * streamed) * block_d * elem_bytes


def candidate_tiles(kernel: str, block_d: int, elem_bytes: int, mask_block: int | None = None) -> list[TlTile]:
    """The tiles worth timing for one call: its head-dim class's candidates that fit in shared memory for this
    dtype, in table order (2-4 of them, so first-call tuning stays short), and for a block-sparse call (§10) that
    divide the mask's blocks, which the kernels walk tile by tile."""
    tiles = [INTERPRETER_TILES[kernel]] if INTERPRET else TL_TILES[kernel][head_dim_class(block_d)]
    kept = [tile for tile in tiles if smem_bytes(kernel, tile, block_d, elem_bytes) <= SMEM_BUDGET
            and (mask_block is None or mask_block % tile.block_m == 0 and mask_block % tile.block_n == 0)]
    if not kept:
        raise ValueError(f"a block mask with block_size={mask_block} is smaller than every {kernel} tile of the "
                         f"kernel for head_dim {block_d}; build the BlockMask with block_size=64 (the default)")
    return kept
