"""The Hopper kernels' fixed shapes and the tiles the tuner chooses among (§12, §13). Plain Python and `tl`
constants, so the host side reads them where Gluon is missing too.

    HopperForwardTile(block_n=128, k_stages=3, v_stages=3, persistent=True, consumers=2)
    HopperBackwardTile(stages=2, dkdv_staged=False)
"""
from typing import NamedTuple

import triton
import triton.language as tl


class HopperForwardTile(NamedTuple):
    """The warp-specialized forward's tile (gluon_forward.attn_fwd_ws): K and V tiles of block_n rows in rings of
    k_stages and v_stages slots (one ring for both where they are equal); `consumers` warpgroups of 64 query rows
    each, so work items (query tiles) of 64 * consumers rows; a program per item, or with `persistent` one per SM
    walking its share of them in pairs."""
    block_n: int
    k_stages: int
    v_stages: int
    persistent: bool
    consumers: int


class HopperBackwardTile(NamedTuple):
    """The warp-specialized backward's tile (gluon_backward.attn_bwd_ws): `stages` slots in the Q/dO ring; with
    dkdv_staged dK and dV leave through shared memory by TMA instead of from registers by pointers."""
    stages: int
    dkdv_staged: bool


# Forward tiles per head dim. The tuner times them and keeps the fastest per shape; each one listed is the fastest on
# some shape (docs/perf_notes.md, 'pairs of work items', 'three consumers', 'split rings'). Three consumers
# (FlashAttention-3's tile at head dim 64) serve long sequences: where 192 does not divide T, the last item of each
# head is partly empty (at T = 1024, two thirds of it) yet takes as long as its busy consumer (§12 "Three consumers
# at hs=64"). Three need S, P and O of 64 rows in 160 registers: too few at hs=128. hs=128's split-ring tile, V in 2
# slots, frees the shared memory that O's staging tiles take (§12 "Split rings").
FORWARD_TILES = {
    64: [HopperForwardTile(128, 3, 3, True, 2), HopperForwardTile(128, 3, 3, False, 2),
         HopperForwardTile(128, 2, 2, True, 2), HopperForwardTile(128, 3, 3, True, 3),
         HopperForwardTile(128, 3, 3, False, 3)],
    128: [HopperForwardTile(128, 3, 3, True, 2), HopperForwardTile(64, 3, 3, True, 2),
          HopperForwardTile(128, 3, 2, True, 2)],
}


def document_tiles(head_dim: int) -> list[HopperForwardTile]:
    """The tiles that keep attention inside documents (§14): two consumers. Three, with 160 registers each, have none
    to spare for the document bounds and spill in the main loop; and documents shorten the rows that three serve."""
    return [tile for tile in FORWARD_TILES[head_dim] if tile.consumers == 2]


def term_tiles(head_dim: int) -> list[HopperForwardTile]:
    """The tiles that take §15's terms (softcap, ALiBi, sinks): two consumers, as document_tiles. Three, with 160
    registers each, spill far more with them (Triton 3.9, hs=64: softcap 388 spill stores against the plain build's
    116; benchmarks/hopper_build.py --terms)."""
    return [tile for tile in FORWARD_TILES[head_dim] if tile.consumers == 2]


# Backward tiles per head dim; the tuner times them and picks per shape. At hs=128 the consumers' dK and dV alone take
# 128 of their 240 registers: a third slot makes the build spill more and run slower, with or without the row values
# in the accumulators (backward.row_values_first), so hs=128 has 2 (§13 "The price"). Staged dK and dV are faster on
# short sequences and at hs=128, and slower at hs=64 on long ones, where the build's schedule of the main loop comes
# out slower (§13 "dK and dV leave"): so both are offered, and the tuner chooses.
BACKWARD_TILES = {64: [HopperBackwardTile(2, False), HopperBackwardTile(3, False), HopperBackwardTile(3, True)],
                  128: [HopperBackwardTile(2, False), HopperBackwardTile(2, True)]}

ROWS = tl.constexpr(64)  # query rows per forward consumer warpgroup: one wgmma is 64 rows tall
# registers per thread, by consumer count: for the launch (the warps, the producer's one padded to four, fill the
# register file), then per consumer after setmaxnreg moves them from the producer, which needs few (PRODUCER_REGS),
# to the consumers, which hold S, P and O
REGS = {2: (168, 240), 3: (128, 160)}
PRODUCER_REGS = tl.constexpr(24)
# the producer's warps: one issues every TMA copy; a gathered problem's row copies (gather_rows) take a warpgroup,
# which the register split above gives the producer anyway
GATHER_WARPS = tl.constexpr(4)
# shared memory a program may take on Hopper (227 KB), less what the barriers and the compiler's scratch need
SHARED_BYTES = tl.constexpr(227 * 1024 - 2048)

# the backward: the forward's split of the registers with two consumers (12 warps at 168 for the launch, then 240 per
# consumer, 24 for the producer), 128 keys per program, 64 per consumer warpgroup, query tiles of 64 rows (the dQ
# matmul's rows, so one wgmma tall)
BACKWARD_LAUNCH_REGS, BACKWARD_CONSUMER_REGS = REGS[2][0], tl.constexpr(REGS[2][1])
KEY_BLOCK = tl.constexpr(128)
KEYS = tl.constexpr(64)
QUERY_BLOCK = tl.constexpr(64)
# a head group's float32 dQ rows (gluon_backward's _key_tile): a fraction of Hopper's L2, so that the group's adds
# (and its Q, dO loads) meet there instead of in DRAM; the exact size matters little (§13 "Where the adds meet";
# docs/perf_notes.md, 'Head groups: where the adds meet')
DQ_GROUP_BYTES = 8 << 20
# a backward grid of fewer programs than this per SM splits each kv head's query heads between programs (§13 "A small
# grid of grouped heads"): one program per key tile of a kv head leaves the SMs idle behind the longest causal tiles
SPLIT_PROGRAMS_PER_SM = 4


@triton.constexpr_function
def o_staged(q_buffers, consumers, k_stages, v_stages, block_n, head_dim):
    """Whether O's staging tiles (one per consumer) fit in shared memory beside the Q buffers and the K and V
    rings, 16-bit elements; not at hs=128 with 128-key tiles in 3 + 3 slots: there the consumers store O from
    registers (in 3 + 2 slots, split rings, it fits). gluon_forward.attn_fwd_ws allocates by it and
    gluon_forward._softmax_rows stores by it."""
    rows = (q_buffers + 1) * consumers * ROWS + (k_stages + v_stages) * block_n
    return rows * head_dim * 2 <= SHARED_BYTES
