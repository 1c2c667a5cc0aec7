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
//   dV += P^T dO and dK += dS^T Q: warp (w % 4, w / 4) takes the same 32 keys by half of D's columns, so dK and dV
//   hold 2 x 32 x D / 2 floats per warp, D per thread, as a warp of 16 keys by all of D would;
//   dQ += dS K: warp w a block of 16 queries by DQ_COLS of D's columns.
// Registers: D for dK and dV, BM for S^T and dP^T: within 255 (nvcc -Xptxas -v, sm_80 to sm_90) but for a value or
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
    constexpr int BN = BWD_BLOCK_N, HALF_M = BM / 2, HALF_D = D / 2;
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
    const int query0 = (warp / 4) * HALF_M, col0 = (warp / 4) * HALF_D;  // its half of the queries, of D
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

    float dk[2][HALF_D / 8][4] = {}, dv[2][HALF_D / 8][4] = {};  // the warp's 32 keys x its half of D
    const float scale_log2 = p.scale * LOG2E;                   // §8 exp2

    // dQ: warp w computes query rows (w % ROW_BLOCKS) * 16 of the step, columns DQ_COLS wide from (w / ROW_BLOCKS)
    constexpr int ROW_BLOCKS = BM / 16, DQ_COLS = D * ROW_BLOCKS / BWD_WARPS;
    const int dq_row = (warp % ROW_BLOCKS) * 16, dq_col = (warp / ROW_BLOCKS) * DQ_COLS;

    // The lane's shared-memory addresses of the first block each product reads, and of its first P^T / dS^T element
    // (a byte offset in the tile); every other block is block_at one of them (rows of buffer buf: + buf * BM)
    const uint32_t k_rows = a_pattern<D>(s_k, key0, 0, lane), v_rows = a_pattern<D>(s_v, key0, 0, lane);
    const uint32_t q_cols = b_pattern<D>(s_q, query0, 0, lane), do_cols = b_pattern<D>(s_do, query0, 0, lane);
    const uint32_t pt_rows = a_pattern<BM>(s_pt, key0, 0, lane), dst_rows = a_pattern<BM>(s_dst, key0, 0, lane);
    const uint32_t do_half = a_pattern<D>(s_do, 0, col0, lane), q_half = a_pattern<D>(s_q, 0, col0, lane);
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

        // §5 with keys as rows: S^T = K Q^T and dP^T = V dO^T, the warp's 32 keys x its HALF_M queries; each Q and dO
        // fragment feeds both key tiles
        float st[2][HALF_M / 8][4] = {}, dpt[2][HALF_M / 8][4] = {};
        // unrolled whole, as the dQ product below: the compiler then loads the next k-step's fragments while this
        // one's products run, and with only two warps per scheduler nothing else hides ldmatrix's latency (no spill
        // on sm_90 since the row-bound masks, nvcc -Xptxas -v)
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t ak[2][4], av[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                ldmatrix_x4(ak[mt], block_at<D>(k_rows, mt * 16, kk * 16));
                ldmatrix_x4(av[mt], block_at<D>(v_rows, mt * 16, kk * 16));
            }
#pragma unroll
            for (int nb = 0; nb < HALF_M / 16; ++nb) {
                uint32_t bq[4], bo[4];
                ldmatrix_x4(bq, block_at<D>(q_cols, buf * BM + nb * 16, kk * 16));
                ldmatrix_x4(bo, block_at<D>(do_cols, buf * BM + nb * 16, kk * 16));
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_16x16<T>(st[mt][2 * nb], st[mt][2 * nb + 1], ak[mt], bq);
                    mma_16x16<T>(dpt[mt][2 * nb], dpt[mt][2 * nb + 1], av[mt], bo);
                }
            }
        }

        // §4: P^T = exp2(S^T * scale * log2(e) - lse), in place of S^T; §6: masked only where the tiles straddle the
        // diagonal or the key tile is ragged, so the other steps skip the visibility tests; §5: dS^T = P^T o (dP^T -
        // Delta). Both go to shared memory in the inputs' dtype (§8). Element e of fragment (mt, nb) is key
        // key0 + mt * 16 + g + 8 (e / 2), query query0 + nb * 8 + 2t + e % 2 (the C layout, flash_common.cuh).
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nb = 0; nb < HALF_M / 8; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    st[mt][nb][e] = fast_exp2(fmaf(st[mt][nb][e], scale_log2, -lse[query0 + nb * 8 + 2 * t + e % 2]));
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
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
            for (int nb = 0; nb < HALF_M / 8; ++nb) {
                const float *prob = st[mt][nb];
                float ds[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) ds[e] = prob[e] * (dpt[mt][nb][e] - delta[query0 + nb * 8 + 2 * t + e % 2]);
#pragma unroll
                for (int r = 0; r < 2; ++r) {  // the fragment's rows g and g + 8
                    const uint32_t at = block_at<BM>(p_element, mt * 16 + 8 * r, nb * 8);
                    *reinterpret_cast<uint32_t *>(reinterpret_cast<unsigned char *>(s_pt) + at) =
                        E::pack(prob[2 * r], prob[2 * r + 1]);
                    *reinterpret_cast<uint32_t *>(reinterpret_cast<unsigned char *>(s_dst) + at) =
                        E::pack(ds[2 * r], ds[2 * r + 1]);
                }
            }
        }
        __syncthreads();

        // §5 dV += P^T dO and dK += dS^T Q (the scale comes once, at the store): the warp's 32 keys x its HALF_D
        // columns; P^T and dS^T (keys x queries) are A fragments, dO and Q (queries x D, k x n) are read with .trans
        // as B, each feeding both key tiles
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            uint32_t ap[2][4], ads[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                ldmatrix_x4(ap[mt], block_at<BM>(pt_rows, mt * 16, kk * 16));
                ldmatrix_x4(ads[mt], block_at<BM>(dst_rows, mt * 16, kk * 16));
            }
#pragma unroll
            for (int dn = 0; dn < HALF_D / 16; ++dn) {
                uint32_t bo[4], bq[4];
                ldmatrix_x4_trans(bo, block_at<D>(do_half, buf * BM + kk * 16, dn * 16));
                ldmatrix_x4_trans(bq, block_at<D>(q_half, buf * BM + kk * 16, dn * 16));
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_16x16<T>(dv[mt][2 * dn], dv[mt][2 * dn + 1], ap[mt], bo);
                    mma_16x16<T>(dk[mt][2 * dn], dk[mt][2 * dn + 1], ads[mt], bq);
                }
            }
        }

        // §5 dQ += dS K: A = dS = (dS^T)^T read with .trans from the keys x queries tile, B = K (keys x D) with
        // .trans; the 16 x DQ_COLS result is added into the float32 buffer (atomics: see the top of this file)
        float dq[DQ_COLS / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            uint32_t a[4];
            ldmatrix_x4_trans(a, block_at<BM>(ds_rows, kk * 16, 0));
#pragma unroll
            for (int dn = 0; dn < DQ_COLS / 16; ++dn) {
                uint32_t bk[4];
                ldmatrix_x4_trans(bk, block_at<D>(k_cols, kk * 16, dn * 16));
                mma_16x16<T>(dq[2 * dn], dq[2 * dn + 1], a, bk);
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = m0 + dq_row + g + 8 * r;
            if (row >= Tq) continue;
            float *dq_accum = p.dq_accum + (row_base + row) * D + dq_col + 2 * t;
#pragma unroll
            for (int dn = 0; dn < DQ_COLS / 8; ++dn) {
#if __CUDA_ARCH__ >= 900  // a pair of floats in one vector atomic: a row's 4 threads fill a 32-byte sector
                atomicAdd(reinterpret_cast<float2 *>(dq_accum + dn * 8), make_float2(dq[dn][2 * r], dq[dn][2 * r + 1]));
#else
                atomicAdd(dq_accum + dn * 8, dq[dn][2 * r]);
                atomicAdd(dq_accum + dn * 8 + 1, dq[dn][2 * r + 1]);
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

    // dK = scale * dS^T Q (§5) and dV, summed over the group's query heads (§7), for keys < Tk
    T *dk_out = static_cast<T *>(p.dk) + b * p.dk_stride.batch + h_kv * p.dk_stride.head;
    T *dv_out = static_cast<T *>(p.dv) + b * p.dv_stride.batch + h_kv * p.dv_stride.head;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = n0 + key0 + mt * 16 + g + 8 * r;
            if (key >= Tk) continue;
#pragma unroll
            for (int dn = 0; dn < HALF_D / 8; ++dn) {
                const int col = col0 + dn * 8 + 2 * t;
                *reinterpret_cast<uint32_t *>(dk_out + key * p.dk_stride.row + col) =
                    E::pack(dk[mt][dn][2 * r] * p.scale, dk[mt][dn][2 * r + 1] * p.scale);
                *reinterpret_cast<uint32_t *>(dv_out + key * p.dv_stride.row + col) =
                    E::pack(dv[mt][dn][2 * r], dv[mt][dn][2 * r + 1]);
            }
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
