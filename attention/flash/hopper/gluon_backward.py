"""The backward pass on Hopper (H100, H200), warp-specialized: five matmuls per tile pair instead of seven (§13).

The math is the `tl` backward's, tl_backward.attn_bwd_dkdv and attn_bwd_dq (§5): with P = exp(S - lse),
dV = P^T dO, dP = dO V^T, dS = P * (dP - Delta), dK = dS^T Q, dQ = dS K. The `tl` backward runs two kernels, dK/dV
and dQ, and the dQ kernel computes S and dP a second time (seven matmuls per tile pair). Here one kernel computes all
three gradients, like FlashAttention-3's: a program owns 128 keys of one (batch, kv head), holds their K, V and the
fp32 dK, dV in its warps, and walks the query tiles that see them. Each tile pair's dQ share is added into a float32
buffer by the copy engine, so five matmuls remain; a pre-pass (Delta, and the buffer zeroed) and a post-pass (the
buffer scaled and rounded into dq) run around it.

  _load_query_tiles   a producer warp: the program's K and V once, then each query tile's Q, dO, lse and Delta by
                      TMA into a ring of STAGES slots, each slot refilled as soon as both consumers are done with it
                      (a warpgroup copying the rows of a gathered problem, §11);
  _key_gradients      two consumer warpgroups, each owning 64 of the 128 keys: per query tile S^T = K Q^T and
                      dP^T = V dO^T, then P^T and dS^T in registers, dV += P^T dO and dK += dS^T Q; both write their
                      dS^T into shared memory, and dQ = dS K over all 128 keys follows: at hs=64 the warpgroups take
                      turns, one computing the whole of dQ for even query tiles, the other for odd ones; at hs=128
                      each computes half of dQ's columns, dQ[:, half] = dS K[:, half], of every tile (warpgroup 1
                      one tile late). The result goes to a staging tile in shared memory that the copy engine adds
                      into the float32 buffer (a TMA reduce: gluon_dq.py) while the warpgroup goes on.

Every program adds into the dQ rows of its head, so the buffer's traffic is the kernel's largest (64 x D float32 per
tile pair, as many bytes as its Q and dO loads). Programs run in groups of heads small enough that a group's buffer
rows stay in L2 (_key_tile, DQ_GROUP_BYTES): the adds then meet in L2 instead of going to DRAM and back.
A gathered problem (MoBA's entries, §11: backward's `gathered`) names for each of its query rows a source row of q:
the producer copies Q, dO, lse and Delta from there, and the consumers add the row's dQ into the buffer's row there
by atomics from their registers, with no staging tile.

Scores are transposed (keys x query rows) because the consumers own keys: S^T's rows are the accumulator rows dK and
dV need as the left operand, with no transpose through shared memory; only dS, which dQ needs with query rows first,
takes that trip.

Synchronisation, with mbarriers (a phase bit flips each time the expected arrivals land):
  kv_ready            the copy engine arrives when the program's K and V are in;
  qdo_ready[s]        the same for the query tile in ring slot s (Q, dO, lse, Delta);
  qdo_empty[s]        count 2: each consumer arrives when its matmuls reading Q and dO of slot s are done;
  ds_ready[b]         count 2: dS^T buffer b (of two) is whole, both halves stored;
  ds_empty[b]         count 1 (hs=64) or 2: buffer b is free again, the dQ matmuls that read it done. Only a
                      warpgroup computing dQ waits for the other's half: at hs=64 the one whose turn it is (buffer
                      b holds its tiles: b == WG), so the consumers meet every other tile, each waiting in turn; at
                      hs=128 both, but warpgroup 1 reads the buffer of the tile before, so it seldom waits there.
  k_free              count 2: both consumers are past their last dQ matmul, so K's rows may take dK (a staged
                      tile's epilogue: dK and dV leave by TMA through the rows K and V took).
The t-th query tile of a program lives in slot t % STAGES, phase (t // STAGES) & 1; its dS^T in buffer t % 2.

The float32 adds land in an order that differs from run to run, so dQ's last bits do too: this backward is not
bit-deterministic (dK and dV are). dispatch.backward takes the `tl` kernels where
torch.use_deterministic_algorithms(True) asks for determinism.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ..tl_tiles import LOG2E
from .gluon_common import copy_load, document_span, gather_rows, key_block, row_sources, score_terms, tma_load
from .gluon_dq import add_dq_cols, dq_cols, dq_targets
from .gluon_dropout import keep_tile
from .gluon_query_tile import (add_sink_rows, document_rows, issue_dq, issue_dv_wait_dp, issue_scores, masked_scores,
                               probabilities, query_slope, query_tile, share_ds, store_key_gradients)
from .shapes import (BACKWARD_CONSUMER_REGS, GATHER_WARPS, KEY_BLOCK, KEYS, PRODUCER_REGS, QUERY_BLOCK)

# lse and Delta tiles: 64 float32 of a (B*Hq*Tq_pad,) buffer, loaded as they are (no swizzle)
ROW_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1))
# a gathered problem's lse and Delta rows, copied by the producer's warps (_gather_row_values)
VALUES_LAYOUT = gl.constexpr(gl.BlockedLayout([1], [32], [GATHER_WARPS], [0]))


@gluon.jit
def _key_tile(n_kv_heads, heads_per_group, H_kv, diag, Tq, Tk, SPANS):
    """Program -> (batch*kv head, first key, first and end query tile that see a key). Programs go in groups of
    heads_per_group (batch, kv head)s, whose dQ rows fit in L2 together (module docstring); in a group, key tile by
    key tile, the first (under the causal mask the one most query rows see, §9 "Work order") first. The last group
    may be smaller. With SPANS (§14) the query tiles run from the first key's document start to the last key's
    document end."""
    n_kblocks = gl.num_programs(0) // n_kv_heads
    per_group = heads_per_group * n_kblocks
    group = gl.program_id(0) // per_group
    heads_here = gl.minimum(heads_per_group, n_kv_heads - group * heads_per_group)
    within = gl.program_id(0) - group * per_group
    bh_kv = group * heads_per_group + within % heads_here
    start_n = within // heads_here * KEY_BLOCK
    # §6 row i sees keys <= i + diag: the first row that sees key start_n is start_n - diag
    first_row = gl.maximum(start_n - diag, 0)
    end_row = Tq
    if SPANS is not None:
        b = bh_kv // H_kv
        first_key_start, _ = document_span(SPANS, b, start_n, Tk)
        _, last_key_end = document_span(SPANS, b, gl.minimum(start_n + KEY_BLOCK, Tk) - 1, Tk)
        first_row = gl.maximum(first_row, first_key_start)
        end_row = last_key_end
    first_m = gl.minimum(first_row, Tq) // QUERY_BLOCK
    return bh_kv, start_n, first_m, gl.maximum(gl.cdiv(end_row, QUERY_BLOCK), first_m)

@gluon.jit
def _load_query_tiles(k_desc, v_desc, Q, DO, LSE, DELTA, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                      kv_ready, qdo_ready, qdo_empty, H_kv, GROUP, n_kv_heads, heads_per_group, Tq, Tq_pad, Tk,
                      diag, SPANS, ROW_SRC, stride_qb, stride_qh, stride_qt, stride_dob, stride_doh, stride_dot,
                      H_src, T_src, KEY_HEADS, KEY_T, KV_SPLIT):
    """The producer warp: K and V of the program's keys, then Q, dO, lse and Delta of every query tile that sees
    them, for each query head of the kv head's group (§7), into the ring: by TMA from descriptors, or for a
    gathered problem (ROW_SRC, §11) by the producer's own copies from their source rows (gather_rows), its keys
    read where they lie (key_block: KEY_HEADS, KEY_T). With KV_SPLIT > 1 the kv heads are split ones (§13 "A small
    grid of grouped heads"): H_kv of them per batch entry, KV_SPLIT of which read the same head of k and v."""
    STAGES: gl.constexpr = q_smem.shape[0]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    bh_kv, start_n, first_m, end_m = _key_tile(n_kv_heads, heads_per_group, H_kv, diag, Tq, Tk, SPANS)
    b, h_kv = bh_kv // H_kv, bh_kv % H_kv
    mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes)
    keys = key_block(b, h_kv // KV_SPLIT, start_n, ROW_SRC, KEY_HEADS, KEY_T)
    tma_load(k_desc, keys, kv_ready, k_smem.reshape([1, 1, KEY_BLOCK, HEAD_DIM]))
    tma_load(v_desc, keys, kv_ready, v_smem.reshape([1, 1, KEY_BLOCK, HEAD_DIM]))
    per_head = end_m - first_m
    for t in range(GROUP * per_head):
        slot = t % STAGES
        mbarrier.wait(qdo_empty.index(slot), ((t // STAGES) & 1) ^ 1)  # a fresh barrier's first wait passes
        ready = qdo_ready.index(slot)
        bh, start_m = query_tile(t, bh_kv, GROUP, first_m, per_head)
        if ROW_SRC is not None:  # a gathered problem (§11)
            row_src, value_src = _tile_sources(ROW_SRC, bh, start_m, Tq)
            gather_rows(row_src, H_src, T_src, q_smem.index(slot), Q, stride_qb, stride_qh,
                                      stride_qt, do_smem.index(slot), DO, stride_dob, stride_doh, stride_dot)
            _gather_row_values(value_src, LSE, DELTA, lse_smem.index(slot), delta_smem.index(slot))
            # the phase completes once every copy has landed, and the arrival below
            async_copy.mbarrier_arrive(ready)
            mbarrier.arrive(ready, count=1)
        else:
            mbarrier.expect(ready, 2 * Q.block_type.nbytes + 2 * LSE.block_type.nbytes)
            h = bh - b * H_kv * GROUP
            tma_load(Q, [b, h, start_m, 0], ready,
                                    q_smem.index(slot).reshape([1, 1, QUERY_BLOCK, HEAD_DIM]))
            tma_load(DO, [b, h, start_m, 0], ready,
                                    do_smem.index(slot).reshape([1, 1, QUERY_BLOCK, HEAD_DIM]))
            row_index = bh * Tq_pad + start_m  # (B*Hq, Tq_pad) flattened
            tma_load(LSE, [row_index], ready, lse_smem.index(slot))
            tma_load(DELTA, [row_index], ready, delta_smem.index(slot))

@gluon.jit
def _tile_sources(ROW_SRC, bh, start_m, Tq):
    """A gathered problem's source rows of query tile start_m of query head bh, in the layouts of
    gather_rows (Q, dO) and of _gather_row_values (lse, Delta). Loaded once the tile's slot is free,
    not a tile ahead as the forward's: the producer has a tile's time to spare here, and the indices held over
    the loop cost more (docs/perf_notes.md section 11)."""
    row_src = ROW_SRC + bh.to(gl.int64) * Tq
    rows = start_m + gl.arange(0, QUERY_BLOCK, layout=VALUES_LAYOUT)  # (M,)
    return (row_sources(row_src, start_m, Tq, QUERY_BLOCK),
            gl.load(row_src + rows, mask=rows < Tq, other=-1))

@gluon.jit
def _gather_row_values(src, LSE, DELTA, lse_smem, delta_smem):
    """The lse and Delta (QUERY_BLOCK,) of a gathered problem's rows, read at their source rows src (_tile_sources) as
    gather_rows reads Q and dO, by the producer's 4-byte copies. A row with none (src -1) gets 0
    for both: its Q and dO rows are zeros, so its dS, and all it adds, are zero."""
    real = src >= 0
    src = gl.maximum(src, 0)
    copy_load(lse_smem, LSE + src, mask=real)
    copy_load(delta_smem, DELTA + src, mask=real)

@gluon.jit
def _key_gradients(WG: gl.constexpr, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, kv_ready,
                   qdo_ready, qdo_empty, ds_ready, ds_empty, k_free, DK, DV, stride_dkb, stride_dkh, stride_dkt,
                   stride_dvb, stride_dvh, stride_dvt, DQ_ACC, dq_smem, ROW_SRC, H_kv, GROUP, n_kv_heads,
                   heads_per_group, Tq, Tq_pad, Tk, diag, unit, scale, SPANS, IDS, stride_ids, cap_scale, SLOPES,
                   stride_slopes_b, stride_slopes_h, CAUSAL_SLOPES, SINK_ROWS, dropout_p, DROP_SEED,
                   ROWS_FIRST: gl.constexpr):
    """Consumer warpgroup WG: dK and dV of keys start_n + WG * 64 ... + 63, and its share of dQ: at hs=64 the whole
    of every other query tile's, at hs=128 half of each tile's columns. ROWS_FIRST: S^T and dP^T start from the
    row values (row_values_first). unit: what turns the scores into base-2 logits (score_terms' units, §8). §15
    cap_scale (scale / softcap), SLOPES (with its strides): FlashAttention's terms, None where the
    call has none (attn_bwd_ws); CAUSAL_SLOPES: SLOPES again where ALiBi is folded under the causal mask, else None: the
    scores take the bias's key part alone, past the origin start_m + Tk - Tq (the query tile's first row's position),
    and the row part is in lse_smem's rows already (backward.attn_bwd_prepare). SINK_ROWS: the sinks' rows, or None.
    §16 dropout_p and DROP_SEED (the call's seed), or None: the forward's mask regenerated per tile (keep_tile), dV
    from the kept P^T, dP^T of the kept scores over 1 - p, dV over 1 - p once at the end."""
    STAGES: gl.constexpr = q_smem.shape[0]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    HALF: gl.constexpr = HEAD_DIM // 2
    # dQ = dS K over all 128 keys, so both halves of dS^T first. hs=64: the warpgroups take turns, each computing
    # the whole (M, D) of the query tiles in its dS^T buffer (t % 2 == WG), and on the others going on without
    # waiting, so the two meet every other tile, and dQ's wgmma is N=64 wide instead of 32, reading dS from shared
    # memory once for twice the products (§13 "dQ in turns"). hs=128: each computes half of dQ's columns of every
    # tile; turns there are slower (whole (M, 128) float32 blocks: 64 KB of staging, 230 KB of shared memory in
    # all; §13 "dQ by columns"). Which one, dq_cols decides
    TURNS: gl.constexpr = dq_cols(HEAD_DIM) == HEAD_DIM
    # without turns warpgroup 1 computes each query tile's dQ half one tile late (§13); with them each
    # warpgroup already skips every other meeting
    LAG: gl.constexpr = 0 if TURNS else 1
    # wgmma accumulators: 4 warps stacked along the rows; S^T and dP^T are (KEYS, M), dK and dV (KEYS, D)
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, QUERY_BLOCK, 16])
    kd_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    lhs_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kd_layout, k_width=2)  # dS^T (P^T alike)
    row_layout: gl.constexpr = gl.SliceLayout(0, st_layout)  # a value per column of S^T: per query row
    bh_kv, start_n, first_m, end_m = _key_tile(n_kv_heads, heads_per_group, H_kv, diag, Tq, Tk, SPANS)
    b, h_kv = bh_kv // H_kv, bh_kv % H_kv
    k_mine = k_smem.slice(WG * KEYS, KEYS)  # (KEYS, D)
    v_mine = v_smem.slice(WG * KEYS, KEYS)
    k_dq = k_smem if TURNS else k_smem.slice(WG * HALF, HALF, dim=1)  # (N, D or D/2): all keys
    dq_col = 0 if TURNS else WG * HALF  # the first of this warpgroup's dQ columns
    first_key = start_n + WG * KEYS
    keys = first_key + gl.arange(0, KEYS, layout=gl.SliceLayout(1, st_layout))  # (KEYS,)
    rows_m = gl.arange(0, QUERY_BLOCK, layout=row_layout)  # (M,)
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, kd_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, kd_layout)
    # §15 softcap and ALiBi, each compiled in only where the call has it: the scores recomputed as the forward made
    # them (score_terms) before the mask, and with softcap dS times 1 - tanh^2. Softcap needs S^T itself, so its S^T
    # starts from zero even with ROWS_FIRST, and lse is subtracted after the cap (ALiBi's bias adds, so it does not
    # mind). The sinks need nothing more for dS: the lse the forward stored holds the sink's share, so P does too;
    # their own gradient takes each row's sum of P dP (add_sink_rows), not with softcap (whose dS^T has its factor)
    SOFTCAP: gl.constexpr = cap_scale is not None
    FOLD: gl.constexpr = CAUSAL_SLOPES is not None
    TERMS: gl.constexpr = SOFTCAP or SLOPES is not None
    DROPOUT: gl.constexpr = DROP_SEED is not None
    # With softcap at hs=128 the tanh tile beside P^T does not fit with dP^T's accumulator in flight over the exp2s:
    # with dP^T issued beside S^T as in the plain build, Triton 3.9's builds spilled 92 stores (157 with ALiBi too)
    # against the plain build's 23; issued once P^T is, beside dV, 78 (30). Neither was timed (never run on a GPU).
    # ROWS_FIRST reaches a partition as a value (int1), not a constant, so a choice the frontend makes reads the head
    # dim, which is row_values_first's rule: LATE_DP implies ROWS_FIRST, lse / softcap in lse_smem
    LATE_DP: gl.constexpr = SOFTCAP and HEAD_DIM == 128
    rows_from, rows_end = document_rows(SPANS, IDS, b, first_key, Tq, Tk)
    if DROPOUT:
        seed = gl.load(DROP_SEED)
    mbarrier.wait(kv_ready, 0)

    per_head = end_m - first_m
    n_tiles = GROUP * per_head  # query tiles: per_head for each query head of the kv head's group (§7)
    for t in range(n_tiles):
        slot = t % STAGES
        buf = t % 2
        start_m = query_tile(t, bh_kv, GROUP, first_m, per_head)[1]
        slope = None  # without ALiBi (Triton 3.6 returns no None from a function, so the branch is here)
        if SLOPES is not None:
            slope = query_slope(SLOPES, query_tile(t, bh_kv, GROUP, first_m, per_head)[0], b, H_kv, GROUP,
                                stride_slopes_b, stride_slopes_h, unit)
        mbarrier.wait(qdo_ready.index(slot), (t // STAGES) & 1)
        if ROW_SRC is not None:  # gathered rows: the producer's copies, visible to the wgmmas that read them
            fence_async_shared()
        lse_row = lse_smem.index(slot).load(row_layout)  # (M,) lse in S^T's units or in base 2; +inf in padding
        q = q_smem.index(slot)  # (M, D)
        do = do_smem.index(slot)
        zeros = gl.zeros([KEYS, QUERY_BLOCK], gl.float32, st_layout)
        st, dpt_token = issue_scores(k_mine, v_mine, q, do, zeros, lse_row, delta_smem.index(slot), SOFTCAP, LATE_DP,
                                     ROWS_FIRST)
        tt = None  # with softcap tanh(scale S / softcap), kept for dS (st is then tanh plus ALiBi's bias / softcap)
        if FOLD:  # §15 the keys' part of ALiBi's bias, past the origin: two keys per thread
            st, tt = score_terms(st, None, (keys - (start_m + Tk - Tq))[:, None], cap_scale, slope)
        elif TERMS:  # §15 as the forward's scores, before the mask
            st, tt = score_terms(st, (start_m + rows_m + Tk - Tq)[None, :], keys[:, None], cap_scale, slope)
        st = masked_scores(st, keys, start_m, rows_m, first_key, diag, Tk, rows_from, rows_end, b, SPANS, IDS,
                           stride_ids)
        pt = probabilities(st, lse_row, lse_smem.index(slot), unit, SOFTCAP, LATE_DP, ROWS_FIRST)
        if DROPOUT:  # §16 the forward's mask of this tile, Z^T (keys by queries), kept in P^T's signs: a dropped
            # entry negated (P^T >= 0, and an entry of 0 gives 0 either way), so no mask stays live over the wgmmas
            bh_q = query_tile(t, bh_kv, GROUP, first_m, per_head)[0]
            pt = gl.where(keep_tile(pt, seed, bh_q.to(gl.int64) * Tq, start_m, first_key, Tk, dropout_p, True), pt,
                          -pt)
        dv_token, pt, dpt = issue_dv_wait_dp(pt, tt, v_mine, do, dv, zeros, dpt_token, delta_smem.index(slot),
                                             DROPOUT, SOFTCAP, LATE_DP, ROWS_FIRST)
        if DROPOUT:  # §16 dP^T - Delta becomes Z^T dP^T / (1 - p) - Delta: a dropped score's dS^T is -P^T Delta
            delta = delta_smem.index(slot).load(row_layout)[None, :]  # (1, M)
            dpt = gl.where(pt > 0.0, (dpt + delta) * (1.0 / (1.0 - dropout_p)), 0.0) - delta
            pt = gl.abs(pt)
        dst_f32 = pt * dpt  # §5 dS^T
        dst = dst_f32.to(q_smem.dtype)
        dk_token = warpgroup_mma(gl.convert_layout(dst, lhs_layout), q, dk, is_async=True)  # dK += dS^T Q
        if SINK_ROWS is not None:  # §15, after the dK product is issued, so the sums run under it
            add_sink_rows(dst_f32, SINK_ROWS, query_tile(t, bh_kv, GROUP, first_m, per_head)[0], start_m, Tq)

        # dQ: both halves of dS^T in shared memory, then this warpgroup's part of dQ (k_dq above) of query tile
        # u: this one, or at hs=128 for warpgroup 1 the one before (LAG), whose halves are usually in already, so
        # that it seldom waits for warpgroup 0 and the two run out of step. At hs=64 a warpgroup whose turn it is
        # not goes on without waiting for the other's half
        share_ds(dst, ds_smem, ds_ready, ds_empty, t, WG)
        u = t - WG * LAG
        if TURNS:
            takes_dq = buf == WG
            n_dq = t // 2  # this warpgroup's dQ blocks before this one
        else:
            takes_dq = u >= 0
            n_dq = u
        if takes_dq:
            dq_token, bh_u, start_u = issue_dq(u, ds_smem, k_dq, ds_ready, bh_kv, GROUP, first_m, per_head)
            targets = None  # the copy engine adds dQ into the head's rows; a gathered problem's rows say where
            if ROW_SRC is not None:
                targets = dq_targets(ROW_SRC, bh_u, start_u, Tq, HEAD_DIM, k_dq.shape[1])
            dv, dk, dq = warpgroup_mma_wait(0, deps=[dv_token, dk_token, dq_token])
            mbarrier.arrive(qdo_empty.index(slot), count=1)  # Q, dO of this slot read: the producer may refill
            add_dq_cols(WG, u, n_dq, dq, dq_col, ds_empty, DQ_ACC, dq_smem, targets, bh_u, start_u, Tq_pad)
        else:  # not this warpgroup's turn (hs=64), or warpgroup 1's first tile at hs=128
            dv, dk = warpgroup_mma_wait(0, deps=[dv_token, dk_token])
            mbarrier.arrive(qdo_empty.index(slot), count=1)
    if WG * LAG == 1:  # warpgroup 1 at hs=128, a tile behind: the last tile's dQ half is still to do
        if n_tiles > 0:
            u = n_tiles - 1
            dq_token, bh_u, start_u = issue_dq(u, ds_smem, k_dq, ds_ready, bh_kv, GROUP, first_m, per_head)
            targets = None
            if ROW_SRC is not None:
                targets = dq_targets(ROW_SRC, bh_u, start_u, Tq, HEAD_DIM, k_dq.shape[1])
            dq = warpgroup_mma_wait(0, deps=[dq_token])
            add_dq_cols(WG, u, u, dq, dq_col, ds_empty, DQ_ACC, dq_smem, targets, bh_u, start_u, Tq_pad)
    tma.store_wait(0)  # the last reductions have read their staging tiles before the program's memory goes
    if DROPOUT:  # §16 the kept P's 1 / (1 - p), once
        dv = dv * (1.0 / (1.0 - dropout_p))
    store_key_gradients(dk, dv, DK, DV, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt, k_smem,
                        v_smem, k_free, b, h_kv, first_key, Tk, scale, WG)

# one function per consumer warpgroup, as gluon_forward._softmax_rows_0/_1: a partition's WG is fixed in it
@gluon.jit
def _key_gradients_0(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, kv_ready, qdo_ready, qdo_empty,
                     ds_ready, ds_empty, k_free, DK, DV, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                     stride_dvt, DQ_ACC, dq_smem, ROW_SRC, H_kv, GROUP, n_kv_heads, heads_per_group, Tq, Tq_pad,
                     Tk, diag, unit, scale, SPANS, IDS, stride_ids, cap_scale, SLOPES, stride_slopes_b,
                     stride_slopes_h, CAUSAL_SLOPES, SINK_ROWS, dropout_p, DROP_SEED, ROWS_FIRST: gl.constexpr):
    _key_gradients(0, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, kv_ready, qdo_ready,
                   qdo_empty, ds_ready, ds_empty, k_free, DK, DV, stride_dkb, stride_dkh, stride_dkt, stride_dvb,
                   stride_dvh, stride_dvt, DQ_ACC, dq_smem, ROW_SRC, H_kv, GROUP, n_kv_heads, heads_per_group,
                   Tq, Tq_pad, Tk, diag, unit, scale, SPANS, IDS, stride_ids, cap_scale, SLOPES, stride_slopes_b,
                   stride_slopes_h, CAUSAL_SLOPES, SINK_ROWS, dropout_p, DROP_SEED, ROWS_FIRST)

@gluon.jit
def _key_gradients_1(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, kv_ready, qdo_ready, qdo_empty,
                     ds_ready, ds_empty, k_free, DK, DV, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                     stride_dvt, DQ_ACC, dq_smem, ROW_SRC, H_kv, GROUP, n_kv_heads, heads_per_group, Tq, Tq_pad,
                     Tk, diag, unit, scale, SPANS, IDS, stride_ids, cap_scale, SLOPES, stride_slopes_b,
                     stride_slopes_h, CAUSAL_SLOPES, SINK_ROWS, dropout_p, DROP_SEED, ROWS_FIRST: gl.constexpr):
    _key_gradients(1, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, kv_ready, qdo_ready,
                   qdo_empty, ds_ready, ds_empty, k_free, DK, DV, stride_dkb, stride_dkh, stride_dkt, stride_dvb,
                   stride_dvh, stride_dvt, DQ_ACC, dq_smem, ROW_SRC, H_kv, GROUP, n_kv_heads, heads_per_group,
                   Tq, Tq_pad, Tk, diag, unit, scale, SPANS, IDS, stride_ids, cap_scale, SLOPES, stride_slopes_b,
                   stride_slopes_h, CAUSAL_SLOPES, SINK_ROWS, dropout_p, DROP_SEED, ROWS_FIRST)

@gluon.jit
def attn_bwd_ws(k_desc, v_desc, Q, DO, LSE, DELTA, DK, DV, stride_dkb, stride_dkh, stride_dkt, stride_dvb,
                 stride_dvh, stride_dvt, DQ_ACC, ROW_SRC, stride_qb, stride_qh, stride_qt, stride_dob, stride_doh,
                 stride_dot, H_src, T_src, H_kv, GROUP, n_kv_heads, heads_per_group, Tq, Tq_pad, Tk, diag, scale,
                 SPANS, IDS, stride_ids, softcap, SLOPES, stride_slopes_b, stride_slopes_h, SINK_ROWS, dropout_p,
                 DROP_SEED, KEY_HEADS, KEY_T, KV_SPLIT, STAGES: gl.constexpr, ROWS_FIRST: gl.constexpr,
                 ALIBI_CAUSAL: gl.constexpr = False):
    """Shared memory and barriers, then the split into the producer and the two consumers (module docstring).
    SPANS (B, 2, T) and IDS (B, T): the spans and ids of documents attention stays inside (§14), or None.
    Q, DO, LSE, DELTA: descriptors of q, dO and the pre-pass's lse and Delta rows; or for a gathered problem
    (ROW_SRC, §11) pointers to q and dO (B, H_src, T_src, D), each row of the problem reading its source row
    (_load_query_tiles), and to the pre-pass's (B*H_src*T_src,) rows; its keys are then the (B, KEY_HEADS, KEY_T)
    rows of k_desc's and v_desc's tensors as one sequence of Tk (key_block), dK and dV flat (1, 1, Tk, D).
    DQ_ACC: the float32 dQ buffer, a descriptor of (QUERY_BLOCK, dq_cols) blocks, or with ROW_SRC a pointer that each
    row adds into at its source row (add_dq_cols).
    KV_SPLIT: how many programs share a key tile of a kv head, each with GROUP of its query heads and DK, DV its own
    (B, H_kv, Tk, D) partial gradients, H_kv counting split heads (§13 "A small grid of grouped heads"); 1 otherwise.
    §15 softcap (a float > 0) and SLOPES (B or 1, Hq) float32 ALiBi slopes with their strides: FlashAttention's terms,
    each None (a constant: the build is the one without it) where the call has none (_key_gradients). SINK_ROWS: with
    sinks (not with softcap or ROW_SRC) the float32 (B*Hq, Tq) rows each query row's sum of P dP is added
    into. §16 dropout_p and DROP_SEED, the call's, or None. ALIBI_CAUSAL: a causal call with SLOPES, ALiBi folded;
    LSE's rows then hold each row's part of the bias (attn_bwd_prepare)."""
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    DQ_COLS: gl.constexpr = dq_cols(HEAD_DIM)
    dtype: gl.constexpr = k_desc.dtype
    # K is read whole (S^T, per warpgroup) and by column halves (dQ): swizzled in atoms of D/2 columns, so a half
    # is whole atoms (the descriptor's layout is the same, kv_layout below)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=HEAD_DIM, element_bitwidth=16, rank=2)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([QUERY_BLOCK, HEAD_DIM], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEY_BLOCK, QUERY_BLOCK], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [KEY_BLOCK, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [KEY_BLOCK, HEAD_DIM], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, QUERY_BLOCK, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, QUERY_BLOCK, HEAD_DIM], q_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, KEY_BLOCK, QUERY_BLOCK], ds_layout)  # dS^T, double-buffered
    # dQ staging: STAGING float32 tiles per consumer warpgroup of the block it adds, laid out as
    # the copy engine reads them. Two at hs=64, so that a reduction runs on while the next dQ is staged; one at
    # hs=128, where the 32 KB it frees goes to L1, which holds the spilled loop scalars (§13 "Head dim 128:
    # registers"). The atomics (ROW_SRC) add from the registers and need none
    dq_smem: gl.constexpr = None
    if ROW_SRC is None:
        STAGING: gl.constexpr = 2 if HEAD_DIM == 64 else 1
        dq_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGING, QUERY_BLOCK, DQ_COLS], DQ_ACC.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, QUERY_BLOCK], ROW_LAYOUT)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, QUERY_BLOCK], ROW_LAYOUT)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qdo_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(k_free, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(qdo_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
        # the warpgroups that read a dS^T buffer for dQ: in turns (whole-width dQ blocks) the one whose turn it is
        mbarrier.init(ds_empty.index(i), count=1 if DQ_COLS == HEAD_DIM else 2)
    fence_async_shared()  # the initialised barriers, visible to the copy engine before its first arrive

    # §15 ALiBi under the causal mask, folded (ALIBI_CAUSAL): the consumers get the slopes again as CAUSAL_SLOPES, as
    # in gluon_forward.attn_fwd_ws
    if ALIBI_CAUSAL:
        causal_slopes = SLOPES
    else:
        causal_slopes: gl.constexpr = None
    # §15 the scores' units (score_terms), as in gluon_forward.attn_fwd_ws; with softcap lse_smem holds lse / softcap
    # (backward.lse_unit)
    if softcap is not None:
        unit = softcap * LOG2E
        cap_scale = scale / softcap
    else:
        unit = scale * LOG2E
        cap_scale: gl.constexpr = None
    consumer_args = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, kv_ready, qdo_ready, qdo_empty,
                     ds_ready, ds_empty, k_free, DK, DV, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                     stride_dvt, DQ_ACC, dq_smem, ROW_SRC, H_kv, GROUP, n_kv_heads, heads_per_group, Tq, Tq_pad,
                     Tk, diag, unit, scale, SPANS, IDS, stride_ids, cap_scale, SLOPES, stride_slopes_b,
                     stride_slopes_h, causal_slopes, SINK_ROWS, dropout_p, DROP_SEED, ROWS_FIRST)
    gl.warp_specialize([
        (_key_gradients_0, consumer_args),  # the default partition: the launch's 4 warps
        (_key_gradients_1, consumer_args),
        (_load_query_tiles, (k_desc, v_desc, Q, DO, LSE, DELTA, k_smem, v_smem, q_smem, do_smem, lse_smem,
                             delta_smem, kv_ready, qdo_ready, qdo_empty, H_kv, GROUP, n_kv_heads, heads_per_group,
                             Tq, Tq_pad, Tk, diag, SPANS, ROW_SRC, stride_qb, stride_qh, stride_qt, stride_dob,
                             stride_doh, stride_dot, H_src, T_src, KEY_HEADS, KEY_T, KV_SPLIT)),
    ], [4, 1 if ROW_SRC is None else GATHER_WARPS], [BACKWARD_CONSUMER_REGS, PRODUCER_REGS])
