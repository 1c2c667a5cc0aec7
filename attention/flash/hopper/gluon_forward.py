"""The forward pass on Hopper (H100, H200), warp-specialized: FlashAttention-3's layout, in Gluon (§12). Why Gluon,
when this kernel runs and how it is tested: forward.py, its host side.

The math is the `tl` forward's, tl_forward.attn_fwd (§2 online softmax, §4 log-sum-exp, §6 causal alignment,
§8 exp2 and fully-masked rows); what changes is which warps do what. There, every warp of a program loads,
multiplies and runs the softmax in turn. Here a program takes work items, 128 or 192 query rows of one (batch,
head) each (one item, or with a persistent grid a share of them in pairs: _work_item), and splits:

  _load_tiles         a producer warp: an item's Q, then its K_j, V_j by TMA into rings of shared-memory slots,
                      each slot refilled as soon as every consumer is done with it (for a gathered problem, §11
                      "Rows read where they are", a warpgroup that copies Q's rows itself: gather_rows);
  _softmax_rows       two or three consumer warpgroups of 64 rows each: the online softmax over the key tiles,
                      S_j = Q K_j^T issued together with P_{j-1} V_{j-1} (async wgmma), so that one
                      warpgroup's softmax runs while the tensor cores multiply (§12 says whose products); then
                      O through a staging tile in shared memory to the copy engine, which stores it while the
                      warpgroup goes on (§12 "O leaves by the copy engine").

Synchronisation, per ring slot s, with mbarriers (a phase bit flips each time the expected arrivals land). K and V
share one ring of K_STAGES slots (K_STAGES == V_STAGES), or each has its own (split rings, V_STAGES < K_STAGES: the
consumers are done with K_j once S_j is computed, with V_j a tile later, so V can make do with fewer slots, and what
that saves holds O's staging tiles at hs=128; §12 "Split rings"):
  k_ready[s]   the copy engine arrives when K_j is in (one ring: K_j and V_j, 2 tiles of bytes announced with expect);
  k_empty[s]   count CONSUMERS: each consumer warpgroup arrives when it has finished reading K_j (one ring: and V_j);
  v_ready[s], v_empty[s]  the same for V_j, with split rings (one ring: they are k_ready and k_empty);
  q_ready[b], q_empty[b]  the same for Q buffer b, which holds items b, b + Q_BUFFERS, ...: at hs=64 two buffers,
               each refilled once all consumers are past their last S of its item; at hs=128, where they hold Q
               in registers, one, refilled once all have loaded it.
The j-th key tile a program loads (counted over its items) lives in slot j % slots of its ring, in that slot's phase
(j // slots) & 1. No barrier spans the whole program, so no warpgroup waits for another.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .gluon_common import document_span, gather_rows, key_block, row_sources, tma_load, tma_store
from .gluon_dropout import dropout_tile
from .gluon_softmax import (acc_layout, alibi_rows, alibi_slope, first_key_tile, fold_sink, item_rows, k_done,
                            mirrored_tile, score_half_tile, scored_tile, softmax_step, v_slot_of, wait_tile)
from .shapes import GATHER_WARPS, PRODUCER_REGS, ROWS, o_staged


@gluon.jit
def program_items(n_work, per_turn):
    """How many work items this program takes: per turn `per_turn` consecutive ones, program p taking turns p,
    p + programs, ... (a program per item: per_turn 1 and a grid of n_work; persistent: pairs, `_work_item`)."""
    n_turns = gl.cdiv(n_work, per_turn)
    mine = gl.cdiv(n_turns - gl.program_id(0), gl.num_programs(0))  # grids never exceed n_turns
    last_is_short = (n_work % per_turn != 0) & (gl.program_id(0) + (mine - 1) * gl.num_programs(0) == n_turns - 1)
    return per_turn * mine - gl.where(last_is_short, per_turn - n_work % per_turn, 0)

@gluon.jit
def _item_tile(t, per_turn, n_m_tiles, BLOCK_M: gl.constexpr):
    """This program's t-th work item -> (batch*head, first query row), as _work_item takes them."""
    w = per_turn * (gl.program_id(0) + (t // per_turn) * gl.num_programs(0)) + t % per_turn
    rank = w % n_m_tiles
    return w // n_m_tiles, gl.where((per_turn == 2) & (rank % 2 == 1), rank // 2,
                                    n_m_tiles - 1 - rank // per_turn) * BLOCK_M

@gluon.jit
def _work_item(t, per_turn, n_m_tiles, Tq, Tk, diag, H, SPANS, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
               DOCUMENTS: gl.constexpr):
    """This program's t-th work item -> (batch*head, first query row, first and end key tile to visit). The query
    tiles of one (batch, head) are consecutive items, so the programs running at the same time share their K and
    V in L2. Under the causal mask a tile's work grows with its position (§12 "A persistent grid"): a program
    per item takes them last (longest) first; a persistent program takes pairs, ordered last, first, second
    last, second, ..., so a pair is a long and a short tile whose key tiles add up to the same count for every
    pair, and every program's share is as long as any other's. With DOCUMENTS the key tiles run from the one
    holding the first row's document start to the last row's last key in its document (§14)."""
    bh, start_m = _item_tile(t, per_turn, n_m_tiles, BLOCK_M)
    # §6 the key tiles the tile's last row sees; at least one, so each consumer has a tile to wait for
    last_row = gl.minimum(start_m + BLOCK_M, Tq) - 1
    last_key = gl.minimum(last_row + diag, Tk - 1)
    first_tile = 0
    if DOCUMENTS:
        first_key, _ = document_span(SPANS, bh // H, start_m, Tq)
        _, last_end = document_span(SPANS, bh // H, last_row, Tq)
        last_key = gl.minimum(last_key, last_end - 1)
        first_tile = gl.maximum(first_key, 0) // BLOCK_N
    return bh, start_m, first_tile, gl.maximum(gl.cdiv(last_key + 1, BLOCK_N), first_tile + 1)

@gluon.jit
def _item_sources(ROW_SRC, t, n_items, per_turn, n_m_tiles, Tq, BLOCK_M: gl.constexpr):
    """A gathered problem's source rows of work item t's two halves (row_sources; -1 throughout past the last
    item): a gathered problem runs two consumers."""
    bh, start_m = _item_tile(t, per_turn, n_m_tiles, BLOCK_M)
    row_src = ROW_SRC + bh.to(gl.int64) * Tq
    n_rows = gl.where(t < n_items, Tq, 0)
    return row_sources(row_src, start_m, n_rows, ROWS), row_sources(row_src, start_m + ROWS, n_rows, ROWS)

@gluon.jit
def _load_tiles(Q, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                v_empty, H, GROUP, n_m_tiles, n_work, per_turn, Tq, Tk, diag, SPANS, ROW_SRC, stride_qb,
                stride_qh, stride_qt, H_src, T_src, KEY_HEADS, KEY_T):
    """The producer warp: for each of the program's work items, Q (once every consumer is done with the
    previous item's), then K_j, V_j. With one ring (K_STAGES == V_STAGES) both into slot j % STAGES, counted
    in by one barrier. With split rings (V_STAGES < K_STAGES) each into its own, K a tile ahead: K_0, K_1,
    V_0, K_2, V_1, ... (the consumers release each K once its S is computed, each V a tile later, after its
    P V). Descriptors are 4-D (B, H, T, D) with a (1, 1, rows, D) block: rows past T arrive as zeros,
    whatever the strides (§9), so a ragged last tile needs no special load. With ROW_SRC (a gathered problem,
    §11) Q is a pointer to q (B, H_src, T_src, D) and its rows come by gather_rows, and the keys are k's rows where
    they lie (key_block: KEY_HEADS, KEY_T)."""
    # Triton 3.6 hands warp_specialize's constexpr arguments to a partition as tensors: constants come from shapes
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    CONSUMERS: gl.constexpr = q_smem.shape[0] // Q_BUFFERS  # a Q buffer holds 64 rows per consumer
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    BLOCK_M: gl.constexpr = CONSUMERS * ROWS
    SPLIT: gl.constexpr = v_smem.shape[0] < k_smem.shape[0]
    DOCUMENTS: gl.constexpr = SPANS is not None  # §14 (None survives the hand-over as a constant; False does not)
    loaded = 0  # key tiles loaded so far, over all items: tile number t goes to slot t % (its ring's slots)
    n_items = program_items(n_work, per_turn)
    if ROW_SRC is not None:  # a gathered problem (§11): the first item's source rows, later ones' an item ahead
        src_0, src_1 = _item_sources(ROW_SRC, 0, n_items, per_turn, n_m_tiles, Tq, BLOCK_M)
    for item in range(n_items):
        bh, start_m, first_tile, end_tile = _work_item(item, per_turn, n_m_tiles, Tq, Tk, diag, H, SPANS, BLOCK_N,
                                                       BLOCK_M, DOCUMENTS)
        b, h = bh // H, bh % H
        ring0 = loaded - first_tile  # key tile j of this item is ring tile number ring0 + j
        # the item's Q buffer, once every consumer is done with the item it held before; a fresh mbarrier counts
        # as having completed the phase before phase 0: the first waits pass at once
        buffer = item % Q_BUFFERS
        mbarrier.wait(q_empty.index(buffer), ((item // Q_BUFFERS) & 1) ^ 1)
        if ROW_SRC is not None:
            gather_rows(src_0, H_src, T_src, q_smem.index(buffer * 2), Q, stride_qb, stride_qh, stride_qt,
                        None, None, 0, 0, 0)
            gather_rows(src_1, H_src, T_src, q_smem.index(buffer * 2 + 1), Q, stride_qb, stride_qh, stride_qt,
                        None, None, 0, 0, 0)
            # the phase completes once every copy has landed, and the arrival below
            async_copy.mbarrier_arrive(q_ready.index(buffer))
            mbarrier.arrive(q_ready.index(buffer), count=1)
            src_0, src_1 = _item_sources(ROW_SRC, item + 1, n_items, per_turn, n_m_tiles, Tq, BLOCK_M)
        else:
            mbarrier.expect(q_ready.index(buffer), CONSUMERS * Q.block_type.nbytes)
            for wg in gl.static_range(CONSUMERS):
                tma_load(Q, [b, h, start_m + wg * ROWS, 0], q_ready.index(buffer),
                          q_smem.index(buffer * CONSUMERS + wg).reshape([1, 1, ROWS, HEAD_DIM]))
        for j in range(first_tile, end_tile):
            key_j = key_block(b, h // GROUP, j * BLOCK_N, ROW_SRC, KEY_HEADS, KEY_T)
            if SPLIT:
                _load_tile(k_desc, k_smem, k_ready, k_empty, ring0 + j, key_j, 1)
                if j > first_tile:
                    _load_tile(v_desc, v_smem, v_ready, v_empty, ring0 + j - 1,
                               key_block(b, h // GROUP, (j - 1) * BLOCK_N, ROW_SRC, KEY_HEADS, KEY_T), 1)
            else:
                slot = _load_tile(k_desc, k_smem, k_ready, k_empty, ring0 + j, key_j, 2)
                tma_load(v_desc, key_j, k_ready.index(slot), v_smem.index(slot).reshape([1, 1, BLOCK_N, HEAD_DIM]))
        if SPLIT:
            _load_tile(v_desc, v_smem, v_ready, v_empty, ring0 + end_tile - 1,
                       key_block(b, h // GROUP, (end_tile - 1) * BLOCK_N, ROW_SRC, KEY_HEADS, KEY_T), 1)
        loaded += end_tile - first_tile

@gluon.jit
def _load_tile(desc, ring, ready, empty, t, coord, tiles: gl.constexpr):
    """Key tile number t (counted over the program's items) of K or V, the block at coord, into its ring's slot
    t % slots, once every consumer released the tile that slot held before; ready[slot] counts `tiles` tiles'
    bytes in (2: the V tile of a joint ring comes in on K's barrier). -> the slot."""
    SLOTS: gl.constexpr = ring.shape[0]
    slot = t % SLOTS
    mbarrier.wait(empty.index(slot), ((t // SLOTS) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), tiles * desc.block_type.nbytes)
    tma_load(desc, coord, ready.index(slot), ring.index(slot).reshape([1, 1, ring.shape[1], ring.shape[2]]))
    return slot

@gluon.jit
def _softmax_rows(WG: gl.constexpr, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                  o_desc, o_smem, O, stride_ob, stride_oh, stride_ot, LSE, H, n_m_tiles, n_work, per_turn, Tq, Tk,
                  diag, unit, SPANS, IDS, stride_ids, ROW_SRC, cap_scale, SLOPES, stride_slopes_b, stride_slopes_h,
                  SINK_LOGITS, stride_sinks, dropout_p, DROP_SEED, CAUSAL_SLOPES, FULL_SLOPES):
    """Consumer warpgroup WG: for each of the program's work items, rows start_m + WG * 64 ... + 63, their O
    and log-sum-exp. O goes through its staging tile o_smem[WG] to the copy engine (o_desc), or where
    attn_fwd_ws found no room for staging tiles, from registers (O and its strides). unit: what turns the scores
    the softmax takes into base-2 logits (§8, §15 score_terms' units). §15 cap_scale (scale / softcap), SLOPES and
    SINK_LOGITS (with their strides): FlashAttention's terms, each None where the call has none (attn_fwd_ws);
    CAUSAL_SLOPES: SLOPES again where ALiBi is folded under the causal mask (tile_terms' FOLD), else None;
    FULL_SLOPES: SLOPES again where it is folded on full attention (mirrored_terms), else None. §16 dropout_p and
    DROP_SEED (the call's (1,) int64 seed), or None: P's dropped probabilities are zeroed before each P V
    (gluon_dropout), the mask the `tl` kernels draw, and O divided by l (1 - dropout_p)."""
    K_STAGES: gl.constexpr = k_smem.shape[0]
    V_STAGES: gl.constexpr = v_smem.shape[0]
    SPLIT: gl.constexpr = V_STAGES < K_STAGES  # K and V in rings of their own (_load_tiles)
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    CONSUMERS: gl.constexpr = q_smem.shape[0] // Q_BUFFERS
    BLOCK_M: gl.constexpr = CONSUMERS * ROWS
    O_STAGED: gl.constexpr = o_staged(Q_BUFFERS, CONSUMERS, K_STAGES, V_STAGES, BLOCK_N, HEAD_DIM)  # as allocated
    DOCUMENTS: gl.constexpr = SPANS is not None  # §14, as _load_tiles
    # §15 FlashAttention's terms, each compiled in only where the call has it (None survives the hand-over to a
    # partition as a constant): softcap and ALiBi change the scores before the mask and the max (scored_tile), the
    # sink joins each row's denominator after the last tile (fold_sink)
    SINKS: gl.constexpr = SINK_LOGITS is not None
    # ALiBi under the causal mask: the scores take the bias's key part alone, and its row part, a constant of the
    # row, comes off m at the end (alibi_rows), so lse is the true one. On full attention (FULL) the key tiles left
    # or right of the rows take their own key part, and their row part moves m's reference per tile (mirrored_terms)
    FOLD: gl.constexpr = CAUSAL_SLOPES is not None
    FULL: gl.constexpr = FULL_SLOPES is not None
    DROPOUT: gl.constexpr = DROP_SEED is not None
    o_layout: gl.constexpr = acc_layout(HEAD_DIM)  # wgmma's accumulator layouts: O's, and S's (acc_layout(BLOCK_N))
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)  # P from registers
    s_rows: gl.constexpr = gl.SliceLayout(1, acc_layout(BLOCK_N))
    # At hs=128 S = Q K^T takes Q from registers (32 per thread), so the wgmma reads only K from shared memory,
    # the busier unit at hs=128: with both operands there, a 64-key tile asks shared memory for all the bytes per
    # clock it has. At hs=64 the softmax is the busier unit, and Q stays in shared memory (§12 "Overlap inside a
    # consumer"; faster at hs=128, slower at hs=64: docs/perf_notes.md, 'hs=128: Q in registers').
    Q_IN_REGISTERS: gl.constexpr = HEAD_DIM == 128
    q_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout(BLOCK_N), k_width=2)
    # A last key tile of which no row sees past the first half (under the causal mask, the diagonal tile of the
    # first warpgroup's rows) is taken by that half only: S of N/2 columns, the same rows in each thread. Only at
    # hs=64 with two consumers: with three, and at hs=128, ptxas schedules the builds' main loops worse and the
    # tile is taken whole (§12 "Half a tile at the diagonal"; docs/perf_notes.md, 'half a tile at the
    # diagonal'). So where the half tile runs, Q is in shared memory (not Q_IN_REGISTERS)
    HALF_TILES: gl.constexpr = HEAD_DIM == 64 and CONSUMERS == 2 and not DROPOUT  # dropout: whole tiles (§16)
    if DROPOUT:
        seed = gl.load(DROP_SEED)
    seen_tiles = 0  # key tiles of earlier items
    for item in range(program_items(n_work, per_turn)):
        bh, start_m, first_tile, end_tile = _work_item(item, per_turn, n_m_tiles, Tq, Tk, diag, H, SPANS, BLOCK_N,
                                                       BLOCK_M, DOCUMENTS)
        ring0 = seen_tiles - first_tile  # key tile j of this item is ring tile number ring0 + j
        slope = None  # without ALiBi (Triton 3.6 returns no None from a function, so the branch is here)
        if SLOPES is not None:
            slope = alibi_slope(SLOPES, bh, H, stride_slopes_b, stride_slopes_h, unit)
        first_row, mask_from, every_from, n_mine, n_full, q = item_rows(
            start_m, first_tile, item, bh, H, Tq, Tk, diag, SPANS, IDS, q_smem, q_ready, q_empty, ROW_SRC, WG, BLOCK_N,
            HALF_TILES, Q_IN_REGISTERS, q_operand)
        buffer = item % Q_BUFFERS

        # tile 0 alone: S_0, its softmax; from then on each S_j goes to the tensor cores with P_{j-1} V_{j-1}.
        # With split rings each K is released once its S is computed, each V once its P V is; with one ring both
        # once the P V is. The loop carries k_slot, m_i, p, l_i, acc in the order they are first assigned here: in
        # another order ptxas allocates the document builds otherwise
        k_slot, m_i, p, l_i = first_key_tile(q, k_smem, k_ready, k_empty, seen_tiles, first_tile, first_row,
                                             bh, H, mask_from, every_from, diag, Tq, Tk, unit, cap_scale, slope,
                                             SPANS, IDS, stride_ids, SPLIT, FOLD, FULL)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        for j in range(first_tile + 1, n_full):
            # kept inline: as a helper (K_j's wait to the softmax step), its own instructions open the loop body at
            # hs=128, and ptxas allocates the document build otherwise (docs/perf_notes.md section 12)
            prev = k_slot
            k_slot = wait_tile(k_smem, k_ready, ring0 + j)
            if DROPOUT:  # §16 P_{j-1} as P V takes it, its dropped probabilities 0 (l_i summed them all)
                p = dropout_tile(p, seed, bh.to(gl.int64) * Tq, first_row, (j - 1) * BLOCK_N, Tk, dropout_p)
            p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
            s_token = warpgroup_mma(q, k_smem.index(k_slot).permute((1, 0)),
                                    gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout(BLOCK_N)), use_acc=False,
                                    is_async=True)
            v_slot = v_slot_of(v_smem, v_ready, ring0 + j - 1, prev, SPLIT)
            o_token = warpgroup_mma(p_op, v_smem.index(v_slot), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s_token])  # S_j is ready; P_{j-1} V_{j-1} may still be running
            k_done(k_empty, k_slot, SPLIT)
            if FULL:
                s, row_shift = mirrored_tile(s, j * BLOCK_N, first_row, bh, H, mask_from, every_from, diag, Tq, Tk,
                                             unit, cap_scale, slope, SPANS, IDS, stride_ids)
                p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, unit, row_shift)
            else:
                s = scored_tile(s, j * BLOCK_N, first_row, bh, H, mask_from, every_from, diag, Tq, Tk, cap_scale,
                                slope, SPANS, IDS, stride_ids, FOLD)
                p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, unit, None)
            # ptxas (Triton 3.6's) schedules this wait at the top of the softmax, so the softmax runs under the
            # other warpgroup's matmuls, not its own; forcing this order is no faster, as the consumers keep the
            # tensor cores fed for each other (§12 "Overlap inside a consumer")
            acc = warpgroup_mma_wait(0, deps=[o_token])
            mbarrier.arrive(v_empty.index(v_slot), count=1)  # done with V_{j-1} (one ring: K_{j-1} too): refill
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        # each branch waits for its last P V itself: with a wgmma in flight across the join, ptxas serializes
        # every wgmma of the kernel. From here to the item's end (the last P V, the unread tiles, O and lse) the
        # code stays inline: a helper's edges there fall between instructions of this function, and ptxas
        # allocates the document builds otherwise (docs/perf_notes.md section 12)
        if HALF_TILES and n_full < n_mine:
            # the last tile's second half lies past every row's last key (under the causal mask, the diagonal
            # tile of the first warpgroup's rows): S and P V over its first half only (§12 "Half a tile at the
            # diagonal")
            k_slot, v_slot, o_token, p_half, alpha, m_half, l_half = score_half_tile(
                ring0 + n_full, n_full, k_slot, p, m_i, l_i, acc, q, k_smem, k_ready, k_empty, v_smem, v_ready,
                first_row, bh, H, diag, Tq, Tk, unit, cap_scale, slope, SPANS, IDS, stride_ids, SPLIT, FOLD, FULL)
            m_i, l_i = gl.convert_layout(m_half, s_rows), gl.convert_layout(l_half, s_rows)
            acc = warpgroup_mma_wait(0, deps=[o_token])
            mbarrier.arrive(v_empty.index(v_slot), count=1)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            mbarrier.arrive(q_empty.index(buffer), count=1)  # Q's last use was S of the last tile
            v_slot = v_slot_of(v_smem, v_ready, ring0 + n_full, k_slot, SPLIT)
            o_token = warpgroup_mma(gl.convert_layout(p_half.to(q_smem.dtype), p_layout),
                                    v_smem.index(v_slot).slice(0, BLOCK_N // 2), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[o_token])
        else:
            if not Q_IN_REGISTERS:
                mbarrier.arrive(q_empty.index(buffer), count=1)  # Q's last use was S of the last tile
            v_slot = v_slot_of(v_smem, v_ready, ring0 + n_full - 1, k_slot, SPLIT)
            if DROPOUT:
                p = dropout_tile(p, seed, bh.to(gl.int64) * Tq, first_row, (n_full - 1) * BLOCK_N, Tk, dropout_p)
            o_token = warpgroup_mma(gl.convert_layout(p.to(q_smem.dtype), p_layout), v_smem.index(v_slot), acc,
                                    is_async=True)
            acc = warpgroup_mma_wait(0, deps=[o_token])
        mbarrier.arrive(v_empty.index(v_slot), count=1)
        for j in range(n_mine, end_tile):  # tiles only the other warpgroups' rows see: release them unread
            k_slot = wait_tile(k_smem, k_ready, ring0 + j)
            k_done(k_empty, k_slot, SPLIT)
            mbarrier.arrive(v_empty.index(v_slot_of(v_smem, v_ready, ring0 + j, k_slot, SPLIT)), count=1)
        seen_tiles += end_tile - first_tile

        # §4, §8: O = acc / l, lse = (m + log2 l) ln 2; a row that saw no key gets O = 0 and lse = +inf
        l_o = gl.convert_layout(l_i, o_rows)
        if FOLD or FULL:  # §15 m less each row's part of ALiBi's bias: the true one, for the sink and lse
            m_i = gl.convert_layout(m_i, o_rows) - alibi_rows(slope, unit, o_rows)
        if SINKS:  # §15 the head's sink joins the denominator: l, m and O as if a key of score sink, value 0, came last
            acc, l_o, m_i = fold_sink(acc, l_o, gl.convert_layout(m_i, o_rows),
                                       gl.load(SINK_LOGITS + (bh % H) * stride_sinks).to(gl.float32))
        seen = l_o > 0
        l_safe = gl.where(seen, l_o, 1.0)
        l_out = l_safe
        if DROPOUT:  # §16 the kept probabilities' 1 / (1 - p), once per row
            l_out = l_safe * (1.0 - dropout_p)
        rows = first_row + gl.arange(0, ROWS, layout=o_rows)  # (ROWS,)
        if O_STAGED:
            # O by the copy engine, which leaves out rows past Tq: the tile goes to shared memory (once the
            # last item's store has read it), and the warpgroup goes on. Stored from registers, O leaves in
            # 4-byte pieces 8 rows apart, many narrow writes the warpgroup waits out (§12 "O leaves by the
            # copy engine")
            o_tile = o_smem.index(WG)
            tma.store_wait(0)
            o_tile.store((acc / l_out[:, None]).to(o_desc.dtype))
            fence_async_shared()  # the stores, visible to the copy engine
            tma_store(o_desc, [bh // H, bh % H, first_row, 0], o_tile.reshape([1, 1, ROWS, HEAD_DIM]))
        else:
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))  # (D,)
            o_base = O + (bh // H).to(gl.int64) * stride_ob + (bh % H).to(gl.int64) * stride_oh
            o_ptrs = o_base + rows.to(gl.int64)[:, None] * stride_ot + cols[None, :]
            gl.store(o_ptrs, (acc / l_out[:, None]).to(O.dtype.element_ty), mask=(rows < Tq)[:, None])
        lse = gl.where(seen, (gl.convert_layout(m_i, o_rows) + gl.log2(l_safe)) * 0.6931471805599453,
                       float("inf"))
        gl.store(LSE + bh.to(gl.int64) * Tq + rows, lse, mask=rows < Tq)
    if O_STAGED:
        tma.store_wait(0)  # the last O has left shared memory before the program ends

# one function per consumer warpgroup: warp_specialize cannot pass a partition a constexpr (WG), so each
# partition fixes its own (the third runs only with three consumers)
@gluon.jit
def _softmax_rows_0(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc,
                    o_smem, O, stride_ob, stride_oh, stride_ot, LSE, H, n_m_tiles, n_work, per_turn, Tq, Tk, diag,
                    unit, SPANS, IDS, stride_ids, ROW_SRC, cap_scale, SLOPES, stride_slopes_b, stride_slopes_h,
                    SINK_LOGITS, stride_sinks, dropout_p, DROP_SEED, CAUSAL_SLOPES, FULL_SLOPES):
    _softmax_rows(0, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, o_smem,
                  O, stride_ob, stride_oh, stride_ot, LSE, H, n_m_tiles, n_work, per_turn, Tq, Tk, diag, unit,
                  SPANS, IDS, stride_ids, ROW_SRC, cap_scale, SLOPES, stride_slopes_b, stride_slopes_h, SINK_LOGITS,
                  stride_sinks, dropout_p, DROP_SEED, CAUSAL_SLOPES, FULL_SLOPES)

@gluon.jit
def _softmax_rows_1(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc,
                    o_smem, O, stride_ob, stride_oh, stride_ot, LSE, H, n_m_tiles, n_work, per_turn, Tq, Tk, diag,
                    unit, SPANS, IDS, stride_ids, ROW_SRC, cap_scale, SLOPES, stride_slopes_b, stride_slopes_h,
                    SINK_LOGITS, stride_sinks, dropout_p, DROP_SEED, CAUSAL_SLOPES, FULL_SLOPES):
    _softmax_rows(1, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, o_smem,
                  O, stride_ob, stride_oh, stride_ot, LSE, H, n_m_tiles, n_work, per_turn, Tq, Tk, diag, unit,
                  SPANS, IDS, stride_ids, ROW_SRC, cap_scale, SLOPES, stride_slopes_b, stride_slopes_h, SINK_LOGITS,
                  stride_sinks, dropout_p, DROP_SEED, CAUSAL_SLOPES, FULL_SLOPES)

@gluon.jit
def _softmax_rows_2(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc,
                    o_smem, O, stride_ob, stride_oh, stride_ot, LSE, H, n_m_tiles, n_work, per_turn, Tq, Tk, diag,
                    unit, SPANS, IDS, stride_ids, ROW_SRC, cap_scale, SLOPES, stride_slopes_b, stride_slopes_h,
                    SINK_LOGITS, stride_sinks, dropout_p, DROP_SEED, CAUSAL_SLOPES, FULL_SLOPES):
    _softmax_rows(2, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, o_smem,
                  O, stride_ob, stride_oh, stride_ot, LSE, H, n_m_tiles, n_work, per_turn, Tq, Tk, diag, unit,
                  SPANS, IDS, stride_ids, ROW_SRC, cap_scale, SLOPES, stride_slopes_b, stride_slopes_h, SINK_LOGITS,
                  stride_sinks, dropout_p, DROP_SEED, CAUSAL_SLOPES, FULL_SLOPES)

@gluon.jit
def attn_fwd_ws(Q, k_desc, v_desc, o_desc, O, LSE, stride_ob, stride_oh, stride_ot, H, GROUP, Tq, Tk, diag,
                 scale, n_work, per_turn, SPANS, IDS, stride_ids, ROW_SRC, stride_qb, stride_qh, stride_qt, H_src,
                 T_src, softcap, SLOPES, stride_slopes_b, stride_slopes_h, SINK_LOGITS, stride_sinks, dropout_p, DROP_SEED, KEY_HEADS,
                 KEY_T, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr,
                 V_STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                 ALIBI_CAUSAL: gl.constexpr = False, ALIBI_FULL: gl.constexpr = False):
    """Sets up the shared memory and barriers, then splits into the producer and the consumers, which
    walk the same work items: n_work = (64 * CONSUMERS)-row query tiles x batch*head, a program taking per_turn
    consecutive ones per turn (`_items`; a program per item, or a persistent grid walking pairs: forward()).
    SPANS (B, 2, T) and IDS (B, T): the spans and ids of documents attention stays inside (§14), or None.
    ROW_SRC: for a gathered problem (§11) the source row of each query row, Q then a pointer to q (B, H_src,
    T_src, D) (_load_tiles), and the keys the (B, KEY_HEADS, KEY_T) rows of k_desc's tensor as one sequence of Tk
    (key_block); or None, Q a descriptor of the queries (KEY_HEADS, KEY_T unused).
    §15 FlashAttention's terms, each None (a constant: the build is the one without it) where the call has none:
    softcap (a float > 0), SLOPES (B or 1, H) float32 ALiBi slopes with their strides, SINK_LOGITS (H,) a sink
    logit per head with its stride (_softmax_rows). ALIBI_CAUSAL: the call is causal (diag = Tk - Tq) and has
    SLOPES: ALiBi is folded (tl_tiles.score_terms' ALIBI_FOLD; the launch passes it only then). ALIBI_FULL: a call
    with SLOPES and no causal mask: ALiBi folded per key tile (gluon_softmax.mirrored_terms)."""
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    n_m_tiles = gl.cdiv(Tq, CONSUMERS * ROWS)
    # K and V share a layout: the same block shape, swizzled for wgmma; 2-D views of the 4-D TMA blocks
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], k_desc.dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], k_desc.dtype)
    # At hs=128 the consumers hold Q in registers and release its buffer as an item starts: one buffer lets the
    # next item's Q load early. At hs=64 they read it from shared memory until their last S: with a second
    # buffer the next item's Q loads while they finish this one (the last softmax, P V, the stores).
    Q_BUFFERS: gl.constexpr = 1 if HEAD_DIM == 128 else 2
    q_smem = gl.allocate_shared_memory(k_desc.dtype, [Q_BUFFERS * CONSUMERS, ROWS, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [K_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [V_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    # O's staging tiles, one per consumer, where they fit (shapes.o_staged)
    O_STAGED: gl.constexpr = o_staged(Q_BUFFERS, CONSUMERS, K_STAGES, V_STAGES, BLOCK_N, HEAD_DIM)
    if O_STAGED:
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS, ROWS, HEAD_DIM], q_layout)
    else:
        o_smem = q_smem  # in its place, not used
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
    if V_STAGES < K_STAGES:  # split rings: V's barriers of its own (_load_tiles)
        v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(V_STAGES):
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=CONSUMERS)
    else:  # one ring: K's barriers count both tiles of a slot
        v_ready, v_empty = k_ready, k_empty
    fence_async_shared()  # the initialised barriers, visible to the copy engine before its first arrive

    # §15 ALiBi under the causal mask (ALIBI_CAUSAL, a launch of a causal call with slopes) is folded: the consumers
    # get the slopes a second time, as CAUSAL_SLOPES, None otherwise (a constexpr reaches a partition as a value under
    # Triton 3.6; None stays a constant)
    if ALIBI_CAUSAL:
        causal_slopes = SLOPES
    else:
        causal_slopes: gl.constexpr = None
    if ALIBI_FULL:  # the same on full attention, folded per key tile (ALIBI_FULL)
        full_slopes = SLOPES
    else:
        full_slopes: gl.constexpr = None
    # §15 the scores' units (score_terms): with softcap the softmax takes tanh's values themselves
    if softcap is not None:
        unit = softcap * 1.4426950408889634
        cap_scale = scale / softcap
    else:
        unit = scale * 1.4426950408889634
        cap_scale: gl.constexpr = None
    consumer_args = (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, o_smem,
                     O, stride_ob, stride_oh, stride_ot, LSE, H, n_m_tiles, n_work, per_turn, Tq, Tk, diag,
                     unit, SPANS, IDS, stride_ids, ROW_SRC, cap_scale, SLOPES, stride_slopes_b,
                     stride_slopes_h, SINK_LOGITS, stride_sinks, dropout_p, DROP_SEED, causal_slopes, full_slopes)
    producer_args = (Q, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                     v_empty, H, GROUP, n_m_tiles, n_work, per_turn, Tq, Tk, diag, SPANS, ROW_SRC, stride_qb,
                     stride_qh, stride_qt, H_src, T_src, KEY_HEADS, KEY_T)
    # the first consumer is the default partition (the launch's 4 warps); the others are given their warps
    PRODUCER_WARPS: gl.constexpr = 1 if ROW_SRC is None else GATHER_WARPS
    if CONSUMERS == 3:
        gl.warp_specialize([(_softmax_rows_0, consumer_args), (_softmax_rows_1, consumer_args),
                            (_softmax_rows_2, consumer_args), (_load_tiles, producer_args)],
                           [4, 4, PRODUCER_WARPS], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_softmax_rows_0, consumer_args), (_softmax_rows_1, consumer_args),
                            (_load_tiles, producer_args)], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
