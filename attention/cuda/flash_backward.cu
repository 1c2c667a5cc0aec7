// The backward pass (§4-§8 of docs/flash_attention.md; §17 sets it beside the Triton one) on tensor cores, in three
// kernels:
//   1. delta_kernel: Delta = rowsum(dO * O) per query row (§5), float32, and the row's dQ buffer zeroed;
//   2. backward_kernel: one thread block per (key tile, batch, kv head) holds its K and V tile in shared memory and
//      walks the query tiles of every query head of its group (§7), recomputing P from lse (§4); it accumulates dK
//      and dV in registers and adds each tile's dQ share into a float32 buffer with atomics;
//   3. dq_kernel: dQ = scale * that buffer, cast to the inputs' dtype.
//
// dQ by atomics, not by a separate pass: the block that holds a key tile already has dS for it, so dQ costs it one
// more product (five per tile pair: S, dP, dV, dK, dQ). A separate dQ kernel, as the Triton kernels of §5 have, must
// recompute S and dP (seven products) and load K and V once per query tile; in exchange it is deterministic. Here the
// order of the float32 additions into dQ varies from run to run (the last bits of dQ do), and the scratch buffer
// costs (B, Hq, Tq, D) float32 per call.
#include <algorithm>
#include <cmath>

#include "flash_common.cuh"

namespace nanoflash_cuda {
namespace {

// Tiles: 128 keys per block, 8 warps, and BM queries per step (128 at D = 64 and 64 at D = 128, or half that where
// a block has less shared memory: launch_backward). Each warp's products read every fragment from shared memory for
// two mma tiles (a warp owning 16 rows would read one per product, and the reads, 128 bytes a clock per SM, would set
// the pace; the forward's two row tiles, same reason):
//   S^T = K Q^T and dP^T = V dO^T: warp (w % 4, w / 4) takes keys 32 (w % 4) ... + 31 by half the step's queries;
//   P^T and dS^T go to shared memory, since the next products split the work another way;
//   dV += P^T dO and dK += dS^T Q: warp (w % 4, w / 4) takes the same 32 keys by all of D, for dV where w < 4 and
//   for dK else: D floats a thread, as both halves of D for both would take, with fewer fragment reads (a P^T or
//   dS^T fragment, not both, beside all of D's dO or Q fragments, each feeding two products);
//   dQ += dS K: warp w a block of 32 queries (two mma row tiles, as above) by DQ_COLS of D's columns.
// Registers: D for dK or dV, BM for S^T and dP^T: within 255 (nvcc -Xptxas -v, sm_80 to sm_90) but for a value or
// four parked in local memory at the larger steps, read once a step. Shared memory: K and V (2 x 128 x D), Q and dO
// in STAGES buffers each (2 x STAGES x BM x D), P^T and dS^T (2 x 128 x BM), in 2-byte elements, and lse and Delta:
// at D = 128 161 KiB with 64 queries double buffered (sm_80, sm_90), else 112.5 KiB with 32, or 96.3 KiB single
// buffered (sm_86, sm_89: 99 KiB); at D = 64 162 KiB with 128 queries, else 97 KiB with 64. Fewer, larger steps pay
// each step's barriers and bookkeeping less often, and each K and V fragment feeds twice the products.
constexpr int BWD_BLOCK_N = 128, BWD_WARPS = 8, BWD_THREADS = 32 * BWD_WARPS;

template <int D, int BM, int STAGES>
constexpr int backward_smem_bytes() {
    return (2 * BWD_BLOCK_N * D + 2 * STAGES * BM * D + 2 * BWD_BLOCK_N * BM) * 2 + 2 * STAGES * BM * 4;
}

// acc += A B^T, D deep (§5 with keys as rows: S^T = K Q^T or dP^T = V dO^T): the warp's 32 keys (two mma row tiles)
// of the K or V tile, whose first block's lane address is a_rows, by HALF_M queries of the Q or dO tile, from b_cols.
// Each B fragment feeds both key tiles. Unrolled whole: the next k-step's fragments load while this one's products
// run, which two warps a scheduler cannot otherwise hide (no spill on sm_90 since the row-bound masks, -Xptxas -v).
template <typename T, int D, int HALF_M>
__device__ __forceinline__ void keys_by_queries(float (&acc)[2][HALF_M / 8][4], uint32_t a_rows, uint32_t b_cols) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(a[mt], block_at<D>(a_rows, mt * 16, kk * 16));
#pragma unroll
        for (int nb = 0; nb < HALF_M / 16; ++nb) {
            uint32_t b[4];
            ldmatrix_x4(b, block_at<D>(b_cols, nb * 16, kk * 16));
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) mma_16x16<T>(acc[mt][2 * nb], acc[mt][2 * nb + 1], a[mt], b);
        }
    }
}

// §5 Delta_i = sum_d dO_id O_id (= rowsum(P o dP)): D / 8 adjacent threads per query row, each reading 8 columns of
// dO and O in one 16-byte load apiece (a warp per row would read 2 or 4 bytes a lane and take 4x the instructions).
// It also zeroes the row's dQ buffer, which backward_kernel adds into: one pass over the rows instead of a fill kernel.
template <typename T, int D>
__global__ void __launch_bounds__(128) delta_kernel(const AttentionParams p) {
    constexpr int LANES = D / 8;  // threads per row, within one warp
    const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
    const int64_t row = (static_cast<int64_t>(blockIdx.x) * 128 + threadIdx.x) / LANES;
    const int col = (threadIdx.x % LANES) * 8;
    float sum = 0.f;
    if (row < rows) {
        const int i = row % p.seqlen_q, h = (row / p.seqlen_q) % p.heads_q;
        const int64_t b = row / (static_cast<int64_t>(p.seqlen_q) * p.heads_q);
        alignas(16) T d[8], o[8];
        *reinterpret_cast<uint4 *>(d) = *reinterpret_cast<const uint4 *>(
            static_cast<const T *>(p.dout) + b * p.do_stride.batch + h * p.do_stride.head + i * p.do_stride.row + col);
        *reinterpret_cast<uint4 *>(o) = *reinterpret_cast<const uint4 *>(
            static_cast<const T *>(p.o) + b * p.o_stride.batch + h * p.o_stride.head + i * p.o_stride.row + col);
#pragma unroll
        for (int e = 0; e < 8; ++e) sum += Element<T>::to_float(d[e]) * Element<T>::to_float(o[e]);
        float4 *dq_accum = reinterpret_cast<float4 *>(p.dq_accum + row * D + col);
        dq_accum[0] = dq_accum[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (row < rows && col == 0) p.delta[row] = sum;
}

template <typename T, int D, int BM, int STAGES>
__global__ void __launch_bounds__(BWD_THREADS) backward_kernel(const AttentionParams p) {
    constexpr int BN = BWD_BLOCK_N, HALF_M = BM / 2;
    using E = Element<T>;
    extern __shared__ __align__(1024) unsigned char smem[];  // the tiles at multiples of 4 KiB from it (block_at)
    T *s_k = reinterpret_cast<T *>(smem);
    T *s_v = s_k + BN * D;
    T *s_q = s_v + BN * D;            // STAGES buffers of BM x D
    T *s_do = s_q + STAGES * BM * D;  // STAGES buffers of BM x D
    T *s_pt = s_do + STAGES * BM * D;  // P^T, keys x queries (BN x BM)
    T *s_dst = s_pt + BN * BM;         // dS^T, keys x queries
    float *s_lse = reinterpret_cast<float *>(s_dst + BN * BM);  // STAGES buffers of BM, base 2 (§8)
    float *s_delta = s_lse + STAGES * BM;                        // STAGES buffers of BM

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int key0 = (warp % 4) * 32;  // the warp's 32 keys in the block: two mma row tiles
    const int query0 = (warp / 4) * HALF_M;  // its half of the queries
    const bool accumulates_dv = warp < 4;     // its product: dV += P^T dO, else dK += dS^T Q
    const int n0 = blockIdx.x * BN;
    const int b = blockIdx.y / p.heads_kv, h_kv = blockIdx.y % p.heads_kv;
    const int group = p.heads_q / p.heads_kv;  // §7: query heads h_kv * G ... h_kv * G + G - 1 read this kv head
    const int Tq = p.seqlen_q, Tk = p.seqlen_k, shift = Tk - Tq;

    const T *k = static_cast<const T *>(p.k) + b * p.k_stride.batch + h_kv * p.k_stride.head;
    const T *v = static_cast<const T *>(p.v) + b * p.v_stride.batch + h_kv * p.v_stride.head;
    load_tile_async<T, BN, D, BWD_THREADS>(s_k, k, p.k_stride.row, n0, Tk, tid);
    load_tile_async<T, BN, D, BWD_THREADS>(s_v, v, p.v_stride.row, n0, Tk, tid);

    // §6 (the transposed view): query tiles before the first query that sees key n0 are skipped
    const int first_query = p.causal ? max(0, n0 - shift) : 0;
    const int m_first = (first_query / BM) * BM;
    const int m_tiles = first_query < Tq ? (Tq - m_first + BM - 1) / BM : 0;
    const int steps = group * m_tiles;  // §7: every query head of the group, one after the other

    // A step's query head and first row: the query tiles of one head, then of the next (§7), stepped by adds, not
    // worked out from the step's index (a division by m_tiles each time). issue: the asynchronous loads of the step's
    // Q and dO tiles, and of its rows' lse (§4) and Delta (§5), into buffer buf: all of them arrive while the previous
    // step computes.
    struct Step {
        int head, m0;
    };
    auto next = [&](Step at) { return at.m0 + BM < Tq ? Step{at.head, at.m0 + BM} : Step{at.head + 1, m_first}; };
    auto rows_of = [&](Step at) { return (static_cast<int64_t>(b) * p.heads_q + at.head) * Tq; };  // of lse's rows
    auto issue = [&](Step at, int buf) {
        const int h = at.head, m0 = at.m0;
        const T *q = static_cast<const T *>(p.q) + b * p.q_stride.batch + h * p.q_stride.head;
        const T *dout = static_cast<const T *>(p.dout) + b * p.do_stride.batch + h * p.do_stride.head;
        load_tile_async<T, BM, D, BWD_THREADS>(s_q + buf * BM * D, q, p.q_stride.row, m0, Tq, tid);
        load_tile_async<T, BM, D, BWD_THREADS>(s_do + buf * BM * D, dout, p.do_stride.row, m0, Tq, tid);
        if (tid < BM) {
            const bool valid = m0 + tid < Tq;
            const int64_t row = valid ? rows_of(at) + m0 + tid : 0;
            cp_async_4(s_lse + buf * BM + tid, p.lse + row, valid);
            cp_async_4(s_delta + buf * BM + tid, p.delta + row, valid);  // 0 past Tq
        }
    };
    Step at{h_kv * group, m_first};
    if (steps > 0) issue(at, 0);
    cp_async_commit();  // K, V and the first Q, dO tiles: one copy group

    float dkv[2][D / 8][4] = {};  // the warp's 32 keys x D of dV or dK
    const float scale_log2 = p.scale * LOG2E;                   // §8 exp2

    // dQ: warp w computes query rows (w % ROW_BLOCKS) * 32 of the step, columns DQ_COLS wide from (w / ROW_BLOCKS)
    constexpr int ROW_BLOCKS = BM / 32, DQ_COLS = D * ROW_BLOCKS / BWD_WARPS;
    const int dq_row = (warp % ROW_BLOCKS) * 32, dq_col = (warp / ROW_BLOCKS) * DQ_COLS;

    // The lane's shared-memory addresses of the first block each product reads, and of its first P^T / dS^T element
    // (a byte offset in the tile); every other block is block_at one of them (rows of buffer buf: + buf * BM)
    const uint32_t k_rows = a_pattern<D>(s_k, key0, 0, lane), v_rows = a_pattern<D>(s_v, key0, 0, lane);
    const uint32_t q_cols = b_pattern<D>(s_q, query0, 0, lane), do_cols = b_pattern<D>(s_do, query0, 0, lane);
    const uint32_t pt_rows = a_pattern<BM>(s_pt, key0, 0, lane), dst_rows = a_pattern<BM>(s_dst, key0, 0, lane);
    const uint32_t dkv_a = accumulates_dv ? pt_rows : dst_rows;  // P^T or dS^T, the warp's keys
    const uint32_t dkv_b = a_pattern<D>(accumulates_dv ? s_do : s_q, 0, 0, lane);  // dO or Q
    const uint32_t ds_rows = b_pattern<BM>(s_dst, 0, dq_row, lane), k_cols = a_pattern<D>(s_k, 0, dq_col, lane);
    const uint32_t p_element = swizzle<BM>(key0 + g, query0 + 2 * t) * sizeof(T);

    for (int step = 0; step < steps; ++step, at = next(at)) {
        const int buf = STAGES == 2 ? step & 1 : 0, m0 = at.m0;
        const int64_t row_base = rows_of(at);  // of dq_accum's rows
        cp_async_wait<0>();  // the step's copies, issued while the previous step computed
        // §4 the thread's own lse copy, now arrived, to base 2 (§8); a row past Tq gets +inf, so its P is 0
        if (tid < BM) s_lse[buf * BM + tid] = m0 + tid < Tq ? s_lse[buf * BM + tid] * LOG2E : INFINITY;
        // every thread's copies are visible, and every warp is done with the previous step: its buffer, P^T and dS^T
        __syncthreads();
        // double buffering (the num_stages = 2 of §9): the next step's copies into the other buffer, which the barrier
        // above freed, run while this step computes; with one buffer they are issued at the end of the step
        if (STAGES == 2 && step + 1 < steps) {
            issue(next(at), buf ^ 1);
            cp_async_commit();
        }
        const float *lse = s_lse + buf * BM, *delta = s_delta + buf * BM;

        // §5 with keys as rows: S^T = K Q^T and dP^T = V dO^T, the warp's 32 keys x its HALF_M queries, in an order
        // of the warp's: the two warps of a scheduler (w and w + 4) compute them in turn, so that while one takes the
        // exponentials of its S^T (below: the special-function unit) the other's products keep the tensor cores
        // busy. In one order for all, every warp of the block would reach the exponentials at once (the barriers
        // keep them in step), and the tensor cores would idle through them.
        float st[2][HALF_M / 8][4] = {}, dpt[2][HALF_M / 8][4] = {};
        const bool dp_first = warp >= 4;
        const uint32_t q_step = block_at<D>(q_cols, buf * BM, 0), do_step = block_at<D>(do_cols, buf * BM, 0);
        if (dp_first) keys_by_queries<T, D, HALF_M>(dpt, v_rows, do_step);
        keys_by_queries<T, D, HALF_M>(st, k_rows, q_step);

        // §4: P^T = exp2(S^T * scale * log2(e) - lse), in place of S^T; §6: masked only where the tiles straddle the
        // diagonal or the key tile is ragged, so the other steps skip the visibility tests. Element e of fragment
        // (mt, nb) is key key0 + mt * 16 + g + 8 (e / 2), query query0 + nb * 8 + 2t + e % 2 (the C layout,
        // flash_common.cuh). To shared memory in the inputs' dtype (§8), for dV's product.
#pragma unroll
        for (int nb = 0; nb < HALF_M / 8; ++nb) {
            // the lse of the thread's queries 2t and 2t + 1 of the block
            const float2 row_lse = *reinterpret_cast<const float2 *>(lse + query0 + nb * 8 + 2 * t);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    st[mt][nb][e] = fast_exp2(fmaf(st[mt][nb][e], scale_log2, -(e % 2 ? row_lse.y : row_lse.x)));
        }
        if (n0 + BN > Tk || (p.causal && n0 + BN - 1 > m0 + shift)) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {  // the thread's key rows: tile r / 2, row g + 8 (r % 2) in it
                // the row's first visible query, counted from the thread's first query column (m0 + query0 + 2t)
                const int key = n0 + key0 + (r / 2) * 16 + g + 8 * (r % 2);
                const int first = first_visible_query(key, Tq, Tk, p.causal) - m0 - query0 - 2 * t;
#pragma unroll
                for (int nb = 0; nb < HALF_M / 8; ++nb)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (nb * 8 + e < first) st[r / 2][nb][2 * (r % 2) + e] = 0.f;
            }
        }
        // a fragment row's two elements, packed, to P^T or dS^T (byte offset block_at's)
        auto store_pair = [&](T *tile, int mt, int nb, int r, float lo, float hi) {
            const uint32_t at = block_at<BM>(p_element, mt * 16 + 8 * r, nb * 8);
            *reinterpret_cast<uint32_t *>(reinterpret_cast<unsigned char *>(tile) + at) = E::pack(lo, hi);
        };
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nb = 0; nb < HALF_M / 8; ++nb)
#pragma unroll
                for (int r = 0; r < 2; ++r) store_pair(s_pt, mt, nb, r, st[mt][nb][2 * r], st[mt][nb][2 * r + 1]);

        if (!dp_first) keys_by_queries<T, D, HALF_M>(dpt, v_rows, do_step);

        // §5: dS^T = P^T o (dP^T - Delta), to shared memory for dK's and dQ's products
#pragma unroll
        for (int nb = 0; nb < HALF_M / 8; ++nb) {
            const float2 row_delta = *reinterpret_cast<const float2 *>(delta + query0 + nb * 8 + 2 * t);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                float ds[4];
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    ds[e] = st[mt][nb][e] * (dpt[mt][nb][e] - (e % 2 ? row_delta.y : row_delta.x));
#pragma unroll
                for (int r = 0; r < 2; ++r) store_pair(s_dst, mt, nb, r, ds[2 * r], ds[2 * r + 1]);
            }
        }
        __syncthreads();

        // §5 dV += P^T dO or dK += dS^T Q (the scale comes once, at the store): the warp's 32 keys x D; P^T or dS^T
        // (keys x queries) is the A operand, dO or Q (queries x D, k x n) read with .trans the B operand, each of its
        // fragments feeding both key tiles
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            uint32_t a[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(a[mt], block_at<BM>(dkv_a, mt * 16, kk * 16));
#pragma unroll
            for (int dn = 0; dn < D / 16; ++dn) {
                uint32_t bt[4];
                ldmatrix_x4_trans(bt, block_at<D>(dkv_b, buf * BM + kk * 16, dn * 16));
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) mma_16x16<T>(dkv[mt][2 * dn], dkv[mt][2 * dn + 1], a[mt], bt);
            }
        }

        // §5 dQ += dS K: A = dS = (dS^T)^T read with .trans from the keys x queries tile, B = K (keys x D) with
        // .trans; the 32 x DQ_COLS result is added into the float32 buffer (atomics: see the top of this file). Each K
        // fragment feeds both row tiles: 4 fragment reads per 8 products at the large steps, where 16 rows by twice
        // the columns took 5
        float dq[2][DQ_COLS / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            uint32_t a[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) ldmatrix_x4_trans(a[mt], block_at<BM>(ds_rows, kk * 16, mt * 16));
#pragma unroll
            for (int dn = 0; dn < DQ_COLS / 16; ++dn) {
                uint32_t bk[4];
                ldmatrix_x4_trans(bk, block_at<D>(k_cols, kk * 16, dn * 16));
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) mma_16x16<T>(dq[mt][2 * dn], dq[mt][2 * dn + 1], a[mt], bk);
            }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // the thread's rows: tile r / 2, row g + 8 (r % 2) in it
            const int row = m0 + dq_row + (r / 2) * 16 + g + 8 * (r % 2);
            if (row >= Tq) continue;
            float *dq_accum = p.dq_accum + (row_base + row) * D + dq_col + 2 * t;
            const float(&acc)[DQ_COLS / 8][4] = dq[r / 2];
#pragma unroll
            for (int dn = 0; dn < DQ_COLS / 8; ++dn) {
                const float lo = acc[dn][2 * (r % 2)], hi = acc[dn][2 * (r % 2) + 1];
#if __CUDA_ARCH__ >= 900  // a pair of floats in one vector atomic: a row's 4 threads fill a 32-byte sector
                atomicAdd(reinterpret_cast<float2 *>(dq_accum + dn * 8), make_float2(lo, hi));
#else
                atomicAdd(dq_accum + dn * 8, lo);
                atomicAdd(dq_accum + dn * 8 + 1, hi);
#endif
            }
        }
        if (STAGES == 1 && step + 1 < steps) {
            __syncthreads();  // every warp is done with the one buffer
            issue(next(at), 0);
            cp_async_commit();
        }
    }
    cp_async_wait<0>();  // no step: K and V's copies are still owed

    // dV, or dK = scale * dS^T Q (§5), summed over the group's query heads (§7), for keys < Tk
    const Strides out_stride = accumulates_dv ? p.dv_stride : p.dk_stride;
    T *dkv_out = static_cast<T *>(accumulates_dv ? p.dv : p.dk) + b * out_stride.batch + h_kv * out_stride.head;
    const float out_scale = accumulates_dv ? 1.f : p.scale;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = n0 + key0 + mt * 16 + g + 8 * r;
            if (key >= Tk) continue;
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn)
                *reinterpret_cast<uint32_t *>(dkv_out + key * out_stride.row + dn * 8 + 2 * t) =
                    E::pack(dkv[mt][dn][2 * r] * out_scale, dkv[mt][dn][2 * r + 1] * out_scale);
        }
    }
}

// dQ = scale * dq_accum (§5: the scale applied once), in the inputs' dtype. Both are contiguous (B, Hq, Tq, D)
// (binding.cpp allocates them so), element for element: 8 a thread, read as two float4 and stored as 16 bytes
template <typename T>
__global__ void dq_kernel(const AttentionParams p, int64_t chunks) {
    const float4 *accum = reinterpret_cast<const float4 *>(p.dq_accum);
    uint4 *dq = static_cast<uint4 *>(p.dq);
    const float s = p.scale;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const float4 lo = accum[2 * c], hi = accum[2 * c + 1];
        dq[c] = make_uint4(Element<T>::pack(lo.x * s, lo.y * s), Element<T>::pack(lo.z * s, lo.w * s),
                           Element<T>::pack(hi.x * s, hi.y * s), Element<T>::pack(hi.z * s, hi.w * s));
    }
}

template <typename T, int D, int BM, int STAGES>
cudaError_t launch_key_tiles(const AttentionParams &p) {
    constexpr int smem = backward_smem_bytes<D, BM, STAGES>();
    auto kernel = backward_kernel<T, D, BM, STAGES>;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    const dim3 grid((p.seqlen_k + BWD_BLOCK_N - 1) / BWD_BLOCK_N, p.batch * p.heads_kv);
    kernel<<<grid, BWD_THREADS, smem, p.stream>>>(p);
    return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_backward(const AttentionParams &p) {
    const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
    constexpr int ROWS_PER_BLOCK = 128 / (D / 8);
    delta_kernel<T, D><<<static_cast<unsigned>((rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK), 128, 0, p.stream>>>(p);

    // the largest query step a block's shared memory holds (the device's opt-in maximum): 128 queries at D = 64 or 64
    // at D = 128 with Q and dO double buffered, then 64 or 32 double buffered, then single buffered
    const int smem_max = shared_memory(p).per_block;
    constexpr int LARGE = D == 128 ? 64 : 128, SMALL = D == 128 ? 32 : 64;
    cudaError_t err = smem_max >= backward_smem_bytes<D, LARGE, 2>()   ? launch_key_tiles<T, D, LARGE, 2>(p)
                      : smem_max >= backward_smem_bytes<D, SMALL, 2>() ? launch_key_tiles<T, D, SMALL, 2>(p)
                                                                        : launch_key_tiles<T, D, SMALL, 1>(p);
    if (err != cudaSuccess) return err;

    const int64_t chunks = rows * D / 8, blocks = std::min<int64_t>((chunks + 255) / 256, 65536);
    dq_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, p.stream>>>(p, chunks);
    return cudaGetLastError();
}

}  // namespace

cudaError_t flash_backward(const AttentionParams &p) {
    if (p.bf16)
        return p.head_dim == 64 ? launch_backward<__nv_bfloat16, 64>(p) : launch_backward<__nv_bfloat16, 128>(p);
    return p.head_dim == 64 ? launch_backward<__half, 64>(p) : launch_backward<__half, 128>(p);
}

}  // namespace nanoflash_cuda
