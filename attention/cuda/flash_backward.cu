// The backward pass (§4-§8 of docs/flash_attention.md; §17 sets it beside the Triton one) on tensor cores, in three
// kernels:
//   1. delta_kernel: Delta = rowsum(dO * O) per query row (§5), float32, and the row's dQ buffer zeroed;
//   2. backward_kernel: one thread block per (key tile, batch, kv head) holds its K and V tile in shared memory and
//      walks the query tiles of every query head of its group (§7), recomputing P from lse (§4); it accumulates dK
//      and dV in registers and adds each step's dQ share into a float32 buffer;
//   3. dq_kernel: dQ = scale * that buffer, cast to the inputs' dtype.
//
// dQ by additions, not by a separate pass: the block that holds a key tile already has dS for it, so dQ costs it one
// more product (five per tile pair: S, dP, dV, dK, dQ). A separate dQ kernel, as the Triton kernels of §5 have, must
// recompute S and dP (seven products) and load K and V once per query tile; in exchange it is deterministic. Here the
// order of the float32 additions into dQ varies from run to run (the last bits of dQ do), and the scratch buffer
// costs (B, Hq, Tq, D) float32 per call. The additions: on sm_90 and newer the step's dQ tile is staged in shared
// memory and the copy engine adds it, a bulk reduction per row (BULK_DQ); elsewhere each thread adds its fragments by
// atomics, whose addresses, rebuilt row by row under 255 registers, cost more (perf_notes §14).
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
//   dV += P^T dO and dK += dS^T Q: warp (w % 4, w / 4) takes the same 32 keys by all of D for dV where w < 4 and
//   for dK else (D = 64: one P^T or dS^T fragment a k-step, not both), or by half of D for both (D = 128, where all
//   of D spills): D floats a thread either way;
//   dQ += dS K: warp w a block of 32 queries (two mma row tiles, as above) by DQ_COLS of D's columns.
// Registers: D for dK and dV, BM for S^T and dP^T: within 255 (nvcc -Xptxas -v, sm_80 to sm_90) but for a value or
// three parked in local memory at D = 64's 128-query steps with dQ by atomics, read once a step. Shared memory: K
// and V (2 x 128 x D), Q and dO in STAGES buffers each (2 x STAGES x BM x D), P^T and dS^T (2 x 128 x BM), in 2-byte
// elements, lse and Delta, and with BULK_DQ the float32 dQ tiles: at D = 128 225.5 KiB with 64 queries triple
// buffered and one dQ tile (sm_90), else by atomics 161 KiB double buffered (sm_80), 112.5 KiB with 32, or 96.3 KiB
// single buffered (sm_86, sm_89: 99 KiB); at D = 64 226 KiB with 128 queries double buffered and two dQ tiles (sm_90;
// triple buffered with one, it ran slower), else by atomics 162 KiB (sm_80) or 97 KiB with 64. Fewer, larger steps
// pay each step's barriers and bookkeeping less often, and each K and V fragment feeds twice the products; a third
// buffer lets a step's copies take two steps' time to land.
constexpr int BWD_BLOCK_N = 128, BWD_WARPS = 8, BWD_THREADS = 32 * BWD_WARPS;

// With BULK_DQ (sm_90 and newer) a step's dQ tile is staged in shared memory as BM float32 rows of D, each as its
// row of dQ's buffer lies: row i of a head keeps its 32-byte chunk c at chunk dq_chunk(c, i), so the 4 rows of a
// half-warp's fragment store fall in different banks (unswizzled, all start in bank 0). dq_kernel reads them back.
__device__ __forceinline__ int dq_chunk(int chunk, int row) { return chunk ^ (row % 8); }

template <int D, int BM, int STAGES, int DQ_TILES>
constexpr int backward_smem_bytes() {
    return (2 * BWD_BLOCK_N * D + 2 * STAGES * BM * D + 2 * BWD_BLOCK_N * BM) * 2 + 2 * STAGES * BM * 4 +
           DQ_TILES * BM * D * 4;
}

// acc += A B, K deep: the warp's two mma row tiles (32 rows of A) by N columns of B, every fragment read from shared
// memory, each B fragment feeding both row tiles. A's block (row r, column c) is block_at<A_W>(a, r, c), or, with
// A_T, stored transposed (block_at<A_W>(a, c, r), read with .trans); B is stored n x k (block_at<B_W>(b, n, k)), or,
// with B_T, k x n (read with .trans). Unrolled whole: the next k-step's fragments load while this one's products
// run, which two warps a scheduler cannot otherwise hide (no spill on sm_90 since the row-bound masks, -Xptxas -v).
template <typename T, int K, int N, int A_W, bool A_T, int B_W, bool B_T>
__device__ __forceinline__ void warp_product(float (&acc)[2][N / 8][4], uint32_t a, uint32_t b) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        uint32_t af[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            if constexpr (A_T) ldmatrix_x4_trans(af[mt], block_at<A_W>(a, kk * 16, mt * 16));
            else ldmatrix_x4(af[mt], block_at<A_W>(a, mt * 16, kk * 16));
        }
#pragma unroll
        for (int nb = 0; nb < N / 16; ++nb) {
            uint32_t bf[4];
            if constexpr (B_T) ldmatrix_x4_trans(bf, block_at<B_W>(b, kk * 16, nb * 16));
            else ldmatrix_x4(bf, block_at<B_W>(b, nb * 16, kk * 16));
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) mma_16x16<T>(acc[mt][2 * nb], acc[mt][2 * nb + 1], af[mt], bf);
        }
    }
}

// §5 with keys as rows: S^T = K Q^T or dP^T = V dO^T, D deep: the warp's 32 keys of the K or V tile (a_rows) by
// HALF_M queries of the Q or dO tile (b_cols)
template <typename T, int D, int HALF_M>
__device__ __forceinline__ void keys_by_queries(float (&acc)[2][HALF_M / 8][4], uint32_t a_rows, uint32_t b_cols) {
    warp_product<T, D, HALF_M, D, false, D, false>(acc, a_rows, b_cols);
}

// §4: P^T = exp2(S^T * scale * log2(e) - lse), in place. Element e of fragment (mt, nb) of a warp's keys-by-queries
// tile is key mt * 16 + g + 8 (e / 2), query nb * 8 + 2t + e % 2 of the warp's (the C layout, flash_common.cuh); lse
// holds the step's rows in base 2 (§8) from the warp's first query
template <int HALF_M>
__device__ __forceinline__ void probabilities(float (&st)[2][HALF_M / 8][4], const float *lse, float scale_log2,
                                              int t) {
#pragma unroll
    for (int nb = 0; nb < HALF_M / 8; ++nb) {
        const float2 row_lse = *reinterpret_cast<const float2 *>(lse + nb * 8 + 2 * t);  // queries 2t and 2t + 1
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                st[mt][nb][e] = fast_exp2(fmaf(st[mt][nb][e], scale_log2, -(e % 2 ? row_lse.y : row_lse.x)));
    }
}

// §6: P^T = 0 where the query does not see the key. key: the thread's first key (row g of the warp's first tile),
// query: its first query column (2t of the warp's first)
template <int HALF_M>
__device__ __forceinline__ void hide_unseen(float (&pt)[2][HALF_M / 8][4], int key, int query, int Tq, int Tk,
                                            bool causal) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // the thread's key rows: tile r / 2, row g + 8 (r % 2) in it
        // the row's first visible query, counted from the thread's first query column
        const int first = first_visible_query(key + (r / 2) * 16 + 8 * (r % 2), Tq, Tk, causal) - query;
#pragma unroll
        for (int nb = 0; nb < HALF_M / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (nb * 8 + e < first) pt[r / 2][nb][2 * (r % 2) + e] = 0.f;
    }
}

// A fragment row's two elements, packed in the inputs' dtype (§8), to a keys x queries tile in shared memory (P^T or
// dS^T); element: the byte offset of the lane's first element (block_at's)
template <typename T, int BM>
__device__ __forceinline__ void store_pair(T *tile, uint32_t element, int mt, int nb, int r, float lo, float hi) {
    const uint32_t at = block_at<BM>(element, mt * 16 + 8 * r, nb * 8);
    *reinterpret_cast<uint32_t *>(reinterpret_cast<unsigned char *>(tile) + at) = Element<T>::pack(lo, hi);
}

// P^T, the warp's tile, to shared memory (for dV's product)
template <typename T, int BM, int HALF_M>
__device__ __forceinline__ void store_p(T *s_pt, uint32_t element, const float (&pt)[2][HALF_M / 8][4]) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nb = 0; nb < HALF_M / 8; ++nb)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                store_pair<T, BM>(s_pt, element, mt, nb, r, pt[mt][nb][2 * r], pt[mt][nb][2 * r + 1]);
}

// §5: dS^T = P^T o (dP^T - Delta) to shared memory, for dK's and dQ's products; delta from the warp's first query
template <typename T, int BM, int HALF_M>
__device__ __forceinline__ void store_ds(T *s_dst, uint32_t element, const float (&pt)[2][HALF_M / 8][4],
                                         const float (&dpt)[2][HALF_M / 8][4], const float *delta, int t) {
#pragma unroll
    for (int nb = 0; nb < HALF_M / 8; ++nb) {
        const float2 row_delta = *reinterpret_cast<const float2 *>(delta + nb * 8 + 2 * t);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            float ds[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[e] = pt[mt][nb][e] * (dpt[mt][nb][e] - (e % 2 ? row_delta.y : row_delta.x));
#pragma unroll
            for (int r = 0; r < 2; ++r) store_pair<T, BM>(s_dst, element, mt, nb, r, ds[2 * r], ds[2 * r + 1]);
        }
    }
}

// §5 dV += P^T dO and dK += dS^T Q, the warp's share (the scale comes once, at the store): 32 keys x COLS of each of
// its PRODUCTS. P^T or dS^T (keys x queries, from a_rows) is the A operand, dO or Q (queries x D, k x n, rows from
// b_row of b_rows) read with .trans the B operand, each of its fragments feeding both key tiles. One loop for both
// products, their k-steps interleaved, not warp_product once each: that form runs slower at D = 128 (perf_notes §14)
template <typename T, int D, int BM, int PRODUCTS, int COLS>
__device__ __forceinline__ void add_dkv(float (&dkv)[PRODUCTS][2][COLS / 8][4], const uint32_t (&a_rows)[PRODUCTS],
                                        const uint32_t (&b_rows)[PRODUCTS], int b_row) {
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
        uint32_t a[PRODUCTS][2][4];
#pragma unroll
        for (int i = 0; i < PRODUCTS; ++i)
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(a[i][mt], block_at<BM>(a_rows[i], mt * 16, kk * 16));
#pragma unroll
        for (int dn = 0; dn < COLS / 16; ++dn)
#pragma unroll
            for (int i = 0; i < PRODUCTS; ++i) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, block_at<D>(b_rows[i], b_row + kk * 16, dn * 16));
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) mma_16x16<T>(dkv[i][mt][2 * dn], dkv[i][mt][2 * dn + 1], a[i][mt], b);
            }
    }
}

// The warp's 32 x DQ_COLS of dQ (dq: the C layout, flash_common.cuh) added into the float32 buffer's rows from dq_row
// (the thread's first, row g of the warp's) by atomics (see the top of this file); with RAGGED only those below
// rows_left, each row behind a branch
template <int D, int DQ_COLS, bool RAGGED>
__device__ __forceinline__ void add_dq_rows(float *dq_row, int rows_left, const float (&dq)[2][DQ_COLS / 8][4]) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // the thread's rows: tile r / 2, row g + 8 (r % 2) in it
        const int row = (r / 2) * 16 + 8 * (r % 2);
        if (RAGGED && row >= rows_left) continue;
        float *dq_accum = dq_row + row * D;
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
}

// The warp's 32 x DQ_COLS of dQ into the step's float32 tile in shared memory (for flush_dq). tile_row: the thread's
// first row (g of the warp's: all its rows are g mod 8) at its lane's column (2t); chunk0: the warp's first chunk
template <int D, int DQ_COLS>
__device__ __forceinline__ void stage_dq_rows(float *tile_row, int chunk0, int g,
                                              const float (&dq)[2][DQ_COLS / 8][4]) {
#pragma unroll
    for (int dn = 0; dn < DQ_COLS / 8; ++dn) {
        float *chunk = tile_row + dq_chunk(chunk0 + dn, g) * 8;
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // the thread's rows: tile r / 2, row g + 8 (r % 2) in it
            const int row = (r / 2) * 16 + 8 * (r % 2);
            *reinterpret_cast<float2 *>(chunk + row * D) =
                make_float2(dq[r / 2][dn][2 * (r % 2)], dq[r / 2][dn][2 * (r % 2) + 1]);
        }
    }
    fence_for_bulk();
}

// §5 dQ += dS K, 32 queries x DQ_COLS: A = dS = (dS^T)^T read with .trans from the keys x queries tile (ds_rows), B =
// K (keys x D, k_cols) with .trans; each K fragment feeds both row tiles (4 fragment reads per 8 products at the
// large steps, where 16 rows by twice the columns took 5). Then, with BULK_DQ, into the step's tile in shared memory
// (stage_dq_rows); else added to dQ's buffer from dq_row, rows_left rows at most, by atomics: there a warp whose 32
// rows all exist skips the row tests at D = 128, so its atomics share one address register (the tested form, short
// of registers, rebuilt it each row); at D = 64 that runs slower (perf_notes §14)
template <typename T, int D, int BM, int DQ_COLS, bool BULK_DQ>
__device__ __forceinline__ void add_dq(float *dq_row, float *tile_row, int chunk0, int g, int rows_left,
                                       uint32_t ds_rows, uint32_t k_cols) {
    float dq[2][DQ_COLS / 8][4] = {};
    warp_product<T, BWD_BLOCK_N, DQ_COLS, BM, true, D, true>(dq, ds_rows, k_cols);
    if constexpr (BULK_DQ) return stage_dq_rows<D, DQ_COLS>(tile_row, chunk0, g, dq);
    if constexpr (D == 128)
        if (rows_left >= 32) return add_dq_rows<D, DQ_COLS, false>(dq_row, rows_left, dq);
    add_dq_rows<D, DQ_COLS, true>(dq_row, rows_left, dq);
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

template <typename T, int D, int BM, int STAGES, int DQ_TILES>
__global__ void __launch_bounds__(BWD_THREADS) backward_kernel(const AttentionParams p) {
    constexpr int BN = BWD_BLOCK_N, HALF_M = BM / 2;
    constexpr bool BULK_DQ = DQ_TILES > 0;
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
    float *s_dq = s_delta + STAGES * BM;  // with BULK_DQ: DQ_TILES tiles of dQ, BM x D float32 (dq_chunk's order)

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int key0 = (warp % 4) * 32;  // the warp's 32 keys in the block: two mma row tiles
    const int query0 = (warp / 4) * HALF_M;  // its half of the queries
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
    // Q and dO tiles, and of its rows' lse (§4) and Delta (§5), into buffer buf: all of them arrive while earlier
    // steps compute.
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
    if (STAGES == 3) {  // and the second step's: with three buffers two steps' copies are in flight
        if (steps > 1) issue(next(at), 1);
        cp_async_commit();
    }

    // The warp's share of dV += P^T dO and dK += dS^T Q: at D = 64 one of them over all of D (dV in warps 0-3, dK in
    // 4-7), so each k-step reads one A fragment, not two; at D = 128 both over half of D (w / 4), since one over all
    // of D spills there (nvcc -Xptxas -v) and runs slower (docs/perf_notes.md §14). COLS: a product's columns.
    constexpr bool ONE_PRODUCT = D == 64;
    constexpr int PRODUCTS = ONE_PRODUCT ? 1 : 2, COLS = D / PRODUCTS;
    auto is_dv = [&](int i) { return ONE_PRODUCT ? warp < 4 : i == 0; };  // the warp's product i: dV, else dK
    const int col0 = ONE_PRODUCT ? 0 : (warp / 4) * COLS;
    float dkv[PRODUCTS][2][COLS / 8][4] = {};  // the warp's 32 keys x COLS of each product
    const float scale_log2 = p.scale * LOG2E;  // §8 exp2

    // dQ: warp w computes query rows (w % ROW_BLOCKS) * 32 of the step, columns DQ_COLS wide from (w / ROW_BLOCKS)
    constexpr int ROW_BLOCKS = BM / 32, DQ_COLS = D * ROW_BLOCKS / BWD_WARPS;
    const int dq_row = (warp % ROW_BLOCKS) * 32, dq_col = (warp / ROW_BLOCKS) * DQ_COLS;
    float *dq_stage = s_dq + (dq_row + g) * D + 2 * t;  // the thread's first row of the tile, at its lane's column

    // With BULK_DQ: the tile a step staged is added into dQ's buffer once every warp has written it (after the next
    // step's first barrier, or the loop's), by one bulk reduction per row below Tq, issued by the row's thread, which
    // waits for it to have read the row before the barrier after which the tile is written again: with one tile the
    // step's second; with two (step s stages into tile s % 2) the next step's first, beside its wait for its copies
    // (one scoreboard in SASS: a wait for a reduction waits for the thread's copies too). Other forms ran slower
    // (perf_notes §14). staged: the staged tile's first row in the buffer (of lse's rows) and its rows below Tq.
    constexpr int TILE_COUNT = BULK_DQ ? DQ_TILES : 1;
    int64_t staged_row = 0;
    int staged_rows = 0;
    auto flush_dq = [&](int tile) {
        if (tid < staged_rows) {
            bulk_add(p.dq_accum + (staged_row + tid) * D, s_dq + (tile * BM + tid) * D, D * 4);
            bulk_commit();
        }
    };

    // The lane's shared-memory addresses of the first block each product reads, and of its first P^T / dS^T element
    // (a byte offset in the tile); every other block is block_at one of them (rows of buffer buf: + buf * BM)
    const uint32_t k_rows = a_pattern<D>(s_k, key0, 0, lane), v_rows = a_pattern<D>(s_v, key0, 0, lane);
    const uint32_t q_cols = b_pattern<D>(s_q, query0, 0, lane), do_cols = b_pattern<D>(s_do, query0, 0, lane);
    const uint32_t pt_rows = a_pattern<BM>(s_pt, key0, 0, lane), dst_rows = a_pattern<BM>(s_dst, key0, 0, lane);
    uint32_t dkv_a[PRODUCTS], dkv_b[PRODUCTS];  // a product's P^T or dS^T (the warp's keys), and dO or Q (its columns)
#pragma unroll
    for (int i = 0; i < PRODUCTS; ++i) {
        dkv_a[i] = is_dv(i) ? pt_rows : dst_rows;
        dkv_b[i] = a_pattern<D>(is_dv(i) ? s_do : s_q, 0, col0, lane);
    }
    const uint32_t ds_rows = b_pattern<BM>(s_dst, 0, dq_row, lane), k_cols = a_pattern<D>(s_k, 0, dq_col, lane);
    const uint32_t p_element = swizzle<BM>(key0 + g, query0 + 2 * t) * sizeof(T);

    for (int step = 0; step < steps; ++step, at = next(at)) {
        const int buf = step % STAGES, m0 = at.m0;
        const int64_t row_base = rows_of(at);  // of dq_accum's rows
        // the step's copies, issued while an earlier step computed (with three buffers the next step's may be owed)
        cp_async_wait<STAGES == 3 ? 1 : 0>();
        if (DQ_TILES == 2 && tid < BM) bulk_wait<false>();  // the tile this step stages into has been read
        // §4 the thread's own lse copy, now arrived, to base 2 (§8); a row past Tq gets +inf, so its P is 0
        if (tid < BM) s_lse[buf * BM + tid] = m0 + tid < Tq ? s_lse[buf * BM + tid] * LOG2E : INFINITY;
        // every thread's copies are visible, and every warp is done with the previous step: its buffer, P^T and dS^T
        __syncthreads();
        if constexpr (BULK_DQ) flush_dq((step + TILE_COUNT - 1) % TILE_COUNT);  // the previous step's dQ tile
        // multiple buffering (the num_stages of §9): the copies of the step STAGES - 1 ahead go into the buffer the
        // barrier above freed (the previous step's) and run while the steps before it compute; a group is committed
        // even when empty, since the waits count groups. With one buffer they go at the end of the step
        if (STAGES >= 2) {
            const int free_buf = buf > 0 ? buf - 1 : STAGES - 1;
            if (step + STAGES - 1 < steps) issue(STAGES == 3 ? next(next(at)) : next(at), free_buf);
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

        // §4 P^T from S^T, in place; §6 masked only where the tiles straddle the diagonal or the key tile is ragged,
        // so the other steps skip the visibility tests
        probabilities<HALF_M>(st, lse + query0, scale_log2, t);
        if (n0 + BN > Tk || (p.causal && n0 + BN - 1 > m0 + shift))
            hide_unseen<HALF_M>(st, n0 + key0 + g, m0 + query0 + 2 * t, Tq, Tk, p.causal);
        store_p<T, BM, HALF_M>(s_pt, p_element, st);
        if (!dp_first) keys_by_queries<T, D, HALF_M>(dpt, v_rows, do_step);
        store_ds<T, BM, HALF_M>(s_dst, p_element, st, dpt, delta + query0, t);
        if (DQ_TILES == 1 && tid < BM) bulk_wait<false>();  // the dQ tile has been read
        __syncthreads();  // P^T and dS^T are whole (and the dQ tile free)

        // §5 the warp's share of dV += P^T dO and dK += dS^T Q, dO and Q from the step's buffer; then dQ += dS K,
        // staged (BULK_DQ) or into the float32 buffer's rows from the thread's first (dq_first), those below Tq
        add_dkv<T, D, BM, PRODUCTS, COLS>(dkv, dkv_a, dkv_b, buf * BM);
        const int dq_first = m0 + dq_row + g, tile = step % TILE_COUNT;
        add_dq<T, D, BM, DQ_COLS, BULK_DQ>(p.dq_accum + (row_base + dq_first) * D + dq_col + 2 * t,
                                           dq_stage + tile * BM * D, dq_col / 8, g, Tq - dq_first, ds_rows, k_cols);
        if constexpr (BULK_DQ) {
            staged_row = row_base + m0;
            staged_rows = min(BM, Tq - m0);
        }
        if (STAGES == 1 && step + 1 < steps) {
            __syncthreads();  // every warp is done with the one buffer
            issue(next(at), 0);
            cp_async_commit();
        }
    }
    cp_async_wait<0>();  // no step: K and V's copies are still owed
    if constexpr (BULK_DQ) {  // the last step's dQ tile, once every warp has staged it
        __syncthreads();
        flush_dq((steps + TILE_COUNT - 1) % TILE_COUNT);
        bulk_wait<true>();
    }

    // dV and dK = scale * dS^T Q (§5), the warp's share, summed over the group's query heads (§7), for keys < Tk
#pragma unroll
    for (int i = 0; i < PRODUCTS; ++i) {
        const Strides out_stride = is_dv(i) ? p.dv_stride : p.dk_stride;
        T *out = static_cast<T *>(is_dv(i) ? p.dv : p.dk) + b * out_stride.batch + h_kv * out_stride.head + col0;
        const float out_scale = is_dv(i) ? 1.f : p.scale;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int key = n0 + key0 + mt * 16 + g + 8 * r;
                if (key >= Tk) continue;
#pragma unroll
                for (int dn = 0; dn < COLS / 8; ++dn)
                    *reinterpret_cast<uint32_t *>(out + key * out_stride.row + dn * 8 + 2 * t) =
                        E::pack(dkv[i][mt][dn][2 * r] * out_scale, dkv[i][mt][dn][2 * r + 1] * out_scale);
            }
        }
    }
}

// dQ = scale * dq_accum (§5: the scale applied once), in the inputs' dtype. Both are contiguous (B, Hq, Tq, D)
// (binding.cpp allocates them so): 8 elements a thread, read as two float4 (with BULK_DQ from dq_chunk's place)
// and stored as 16 bytes
template <typename T, int D, bool BULK_DQ>
__global__ void dq_kernel(const AttentionParams p, int64_t chunks) {
    constexpr int ROW_CHUNKS = D / 8;
    const float4 *accum = reinterpret_cast<const float4 *>(p.dq_accum);
    uint4 *dq = static_cast<uint4 *>(p.dq);
    const float s = p.scale;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        int64_t from = c;
        if constexpr (BULK_DQ) {  // rows number fewer than 2^31: a float32 row of D takes 256 bytes or more
            const uint32_t row = static_cast<uint32_t>(c / ROW_CHUNKS);
            from = c - c % ROW_CHUNKS + dq_chunk(c % ROW_CHUNKS, row % static_cast<uint32_t>(p.seqlen_q));
        }
        const float4 lo = accum[2 * from], hi = accum[2 * from + 1];
        dq[c] = make_uint4(Element<T>::pack(lo.x * s, lo.y * s), Element<T>::pack(lo.z * s, lo.w * s),
                           Element<T>::pack(hi.x * s, hi.y * s), Element<T>::pack(hi.z * s, hi.w * s));
    }
}

template <typename T, int D, int BM, int STAGES, int DQ_TILES = 0>
cudaError_t launch_key_tiles(const AttentionParams &p) {
    constexpr int smem = backward_smem_bytes<D, BM, STAGES, DQ_TILES>();
    auto kernel = backward_kernel<T, D, BM, STAGES, DQ_TILES>;
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

    // the largest query step a block's shared memory holds (the device's opt-in maximum): on sm_90 and newer with
    // dQ by bulk reductions, 64 queries at D = 128 with Q and dO triple buffered, or 128 at D = 64 double buffered
    // with two dQ tiles (a third buffer runs slower there); then, dQ by atomics, the large step double buffered; then
    // 32 or 64 double buffered; then single buffered
    const int smem_max = shared_memory(p).per_block;
    int device = 0, major = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    constexpr int LARGE = D == 128 ? 64 : 128, SMALL = D == 128 ? 32 : 64, LARGE_STAGES = D == 128 ? 3 : 2;
    constexpr int DQ_TILES = D == 128 ? 1 : 2;
    const bool bulk_dq = major >= 9 && smem_max >= backward_smem_bytes<D, LARGE, LARGE_STAGES, DQ_TILES>();
    cudaError_t err = bulk_dq ? launch_key_tiles<T, D, LARGE, LARGE_STAGES, DQ_TILES>(p)
                      : smem_max >= backward_smem_bytes<D, LARGE, 2, 0>() ? launch_key_tiles<T, D, LARGE, 2>(p)
                      : smem_max >= backward_smem_bytes<D, SMALL, 2, 0>() ? launch_key_tiles<T, D, SMALL, 2>(p)
                                                                               : launch_key_tiles<T, D, SMALL, 1>(p);
    if (err != cudaSuccess) return err;

    const int64_t chunks = rows * D / 8, blocks = std::min<int64_t>((chunks + 255) / 256, 65536);
    auto to_dq = bulk_dq ? dq_kernel<T, D, true> : dq_kernel<T, D, false>;
    to_dq<<<static_cast<unsigned>(blocks), 256, 0, p.stream>>>(p, chunks);
    return cudaGetLastError();
}

}  // namespace

cudaError_t flash_backward(const AttentionParams &p) {
    if (p.bf16)
        return p.head_dim == 64 ? launch_backward<__nv_bfloat16, 64>(p) : launch_backward<__nv_bfloat16, 128>(p);
    return p.head_dim == 64 ? launch_backward<__half, 64>(p) : launch_backward<__half, 128>(p);
}

}  // namespace nanoflash_cuda
