// The forward pass (§2-§4, §6-§8 of docs/flash_attention.md; §17 sets it beside the Triton one) on tensor cores:
// one thread block per (query tile, batch, head), 4 warps of 32 query rows each, walking the key tiles with K and V
// double-buffered in shared memory.
#include <cmath>

#include "flash_common.cuh"

namespace nanoflash_cuda {
namespace {

// Tiles: 128 query rows (4 warps x 2 row tiles of 16, the M of one mma) by BN keys: 128 at D = 64 and 64 at D = 128
// where an SM holds two such blocks, else half that (launch_forward). Each warp owns two row tiles so that every K and
// V fragment it reads from shared memory feeds two products: with one, the ldmatrix reads (128 bytes a clock per SM)
// and not the tensor cores set the pace. Registers per thread: the output accumulator 2 x 16 x D / 32 = D floats plus
// BN for the scores, 192 at the larger tiles: within 255 (nvcc -Xptxas -v; a value parked in local memory at D = 64).
// Shared memory: Q plus two K and two V buffers, (128 + 4 * BN) * D * 2 bytes = 80 KiB at D = 64 (48 KiB with 64
// keys), 96 KiB at D = 128 (64 KiB with 32 keys). Larger tiles pay each tile's barrier, copies and row reductions
// over more keys.
constexpr int FWD_ROW_TILES = 2, FWD_BLOCK_M = 4 * 16 * FWD_ROW_TILES, FWD_THREADS = 128;
// §17 the lazy rescale: a row's probabilities are taken against a max that may trail the true one by up to this much
// (base 2), so they stay below 2^8, which float32 sums and the fp16/bf16 operands of P V hold as exactly as values
// below 1; the accumulator is rescaled only when a tile's max passes it by more
constexpr float RESCALE_SLACK = 8.f;
// At D = 128 the rescale is two multiplies per score (four with 32-key tiles) and skipping it pays; at D = 64 it is
// one or less, less than the branch costs when a warp's rows disagree, so m stays the exact max there (§17)
template <int D>
__host__ __device__ constexpr bool lazy_rescale() {
    return D == 128;
}

template <int D, int BN>
constexpr int forward_smem_bytes() {
    return (FWD_BLOCK_M + 4 * BN) * D * 2;
}

template <typename T, int D, int BN>
__global__ void __launch_bounds__(FWD_THREADS) forward_kernel(const AttentionParams p) {
    constexpr int BM = FWD_BLOCK_M, MT = FWD_ROW_TILES;
    using E = Element<T>;
    extern __shared__ __align__(1024) unsigned char smem[];  // the tiles at multiples of 4 KiB from it (block_at)
    T *s_q = reinterpret_cast<T *>(smem);
    T *s_k = s_q + BM * D;      // two buffers of BN x D
    T *s_v = s_k + 2 * BN * D;  // two buffers of BN x D

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    // §3 grid (query tiles, B * Hq); the tiles that see the most keys (the last ones, causal) start first
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM, warp_row0 = warp * 16 * MT;  // the warp's rows in the tile
    const int bh = blockIdx.y, b = bh / p.heads_q, h = bh % p.heads_q;
    const int h_kv = h / (p.heads_q / p.heads_kv);  // §7: query head h reads kv head h / G
    const int Tq = p.seqlen_q, Tk = p.seqlen_k;

    const T *q = static_cast<const T *>(p.q) + b * p.q_stride.batch + h * p.q_stride.head;
    const T *k = static_cast<const T *>(p.k) + b * p.k_stride.batch + h_kv * p.k_stride.head;
    const T *v = static_cast<const T *>(p.v) + b * p.v_stride.batch + h_kv * p.v_stride.head;
    T *o = static_cast<T *>(p.o) + b * p.o_stride.batch + h * p.o_stride.head;

    // §6: keys past the tile's last query's last visible key are never loaded
    const int key_end = p.causal ? min(Tk, m0 + BM + Tk - Tq) : Tk;
    const int n_tiles = key_end > 0 ? (key_end + BN - 1) / BN : 0;

    // §3: the Q tile is loaded once; K and V tile 0 come in the same copy group
    load_tile_async<T, BM, D, FWD_THREADS>(s_q, q, p.q_stride.row, m0, Tq, tid);
    if (n_tiles > 0) {
        load_tile_async<T, BN, D, FWD_THREADS>(s_k, k, p.k_stride.row, 0, Tk, tid);
        load_tile_async<T, BN, D, FWD_THREADS>(s_v, v, p.v_stride.row, 0, Tk, tid);
    }
    cp_async_commit();

    // §2: per thread, rows g and g + 8 of each of the warp's row tiles: running max m (base 2, §8), partial sum l over
    // this thread's columns (the group's 4 partial sums are added at the end), and the output accumulator a (MT x 16 x
    // D per warp); row r of the thread is row tile r / 2, row g + 8 * (r % 2) in it
    float acc[MT][D / 8][4] = {};
    float m_run[2 * MT], l_run[2 * MT];
#pragma unroll
    for (int r = 0; r < 2 * MT; ++r) m_run[r] = -INFINITY, l_run[r] = 0.f;
    const float scale_log2 = p.scale * LOG2E;  // §8 exp2: log2(e) folded into the scale once
    // the lane's shared-memory addresses of the first block each product reads; every other block is block_at one of
    // them (rows of buffer buf: + buf * BN)
    const uint32_t q_rows = a_pattern<D>(s_q, warp_row0, 0, lane);
    const uint32_t k_cols = b_pattern<D>(s_k, 0, 0, lane), v_rows = a_pattern<D>(s_v, 0, 0, lane);

    for (int j = 0; j < n_tiles; ++j) {
        const int buf = j & 1, n0 = j * BN;
        cp_async_wait<0>();  // tile j (and Q), issued while tile j - 1 was computed
        __syncthreads();     // every thread's copies are visible, and every warp is done with tile j - 1's buffer
        // double buffering (the num_stages = 2 of §9): tile j + 1's copies into the buffer the barrier above freed
        // run while tile j is computed
        if (j + 1 < n_tiles) {
            load_tile_async<T, BN, D, FWD_THREADS>(s_k + (buf ^ 1) * BN * D, k, p.k_stride.row, n0 + BN, Tk, tid);
            load_tile_async<T, BN, D, FWD_THREADS>(s_v + (buf ^ 1) * BN * D, v, p.v_stride.row, n0 + BN, Tk, tid);
            cp_async_commit();
        }

        // §3 the score tile S = Q K^T, MT x 16 x BN per warp, fp32 accumulation; each K fragment feeds MT products
        float s[MT][BN / 8][4] = {};
#pragma unroll 2  // unrolled fully, ptxas hoists all of K's fragments at D = 128 and spills (nvcc -Xptxas -v)
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], block_at<D>(q_rows, mt * 16, kk * 16));
#pragma unroll
            for (int nb = 0; nb < BN / 16; ++nb) {
                uint32_t bk[4];
                ldmatrix_x4(bk, block_at<D>(k_cols, buf * BN + nb * 16, kk * 16));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_16x16<T>(s[mt][2 * nb], s[mt][2 * nb + 1], a[mt], bk);
            }
        }

        // §6: only a tile that straddles the diagonal, or the ragged last key tile, is masked element by element
        if (n0 + BN > Tk || (p.causal && n0 + BN - 1 > m0 + Tk - Tq)) {
#pragma unroll
            for (int r = 0; r < 2 * MT; ++r) {
                // the row's last visible key, counted from the thread's first column of the tile (n0 + 2t)
                const int row = m0 + warp_row0 + (r / 2) * 16 + g + 8 * (r % 2);
                const int last = last_visible_key(row, Tq, Tk, p.causal) - n0 - 2 * t;
#pragma unroll
                for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (nb * 8 + e > last) s[r / 2][nb][2 * (r % 2) + e] = -INFINITY;
            }
        }

        // §2 online softmax, §8 exp2, for the thread's 2 * MT rows
#pragma unroll
        for (int r = 0; r < 2 * MT; ++r) {
            float(&sr)[BN / 8][4] = s[r / 2];
            const int e0 = 2 * (r % 2);  // the row's two values in each C fragment
            float m_tile = -INFINITY;
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb) m_tile = fmaxf(m_tile, fmaxf(sr[nb][e0], sr[nb][e0 + 1]));
            // §8 exp2: the max in base 2; the scale, positive (the API checks it), commutes with the max and joins
            // each score in the exp2's multiply-add below
            m_tile = group_max(m_tile) * scale_log2;
            const float m_new = fmaxf(m_run[r], m_tile);
            // §17 the lazy rescale: the reference max moves only when the tile's max passes it by more than
            // RESCALE_SLACK, and always on the row's first visible key; §8 fully-masked rows: while m_new is -inf,
            // subtracting 0 makes alpha exp2(-inf) = 0 rather than exp2(-inf - -inf) = NaN
            if (!lazy_rescale<D>() || m_tile > m_run[r] + RESCALE_SLACK) {
                const float alpha = fast_exp2(m_run[r] - (m_new == -INFINITY ? 0.f : m_new));
                m_run[r] = m_new;
                l_run[r] *= alpha;
#pragma unroll
                for (int dn = 0; dn < D / 8; ++dn) {
                    acc[r / 2][dn][e0] *= alpha;
                    acc[r / 2][dn][e0 + 1] *= alpha;
                }
            }
            // §8 the same for p while the row has seen no key
            const float m_sub = m_run[r] == -INFINITY ? 0.f : m_run[r];
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb) {
#pragma unroll
                for (int e = e0; e < e0 + 2; ++e) {
                    sr[nb][e] = fast_exp2(fmaf(sr[nb][e], scale_log2, -m_sub));
                    l_run[r] += sr[nb][e];
                }
            }
        }

        // §3 a += P V: two C tiles of P are one A fragment (flash_common.cuh), cast to the inputs' dtype (§8); each V
        // fragment feeds MT products
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) a_from_c<T>(a[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
            for (int dn = 0; dn < D / 16; ++dn) {
                uint32_t bv[4];
                ldmatrix_x4_trans(bv, block_at<D>(v_rows, buf * BN + kk * 16, dn * 16));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_16x16<T>(acc[mt][2 * dn], acc[mt][2 * dn + 1], a[mt], bv);
            }
        }
    }
    cp_async_wait<0>();  // no tile: the Q copy is still owed

    // §4 the end: O = a / l (0 for a row that saw no key, §8) and lse = m + log2(l), stored in natural log
#pragma unroll
    for (int r = 0; r < 2 * MT; ++r) {
        const float l = group_sum(l_run[r]);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int row = m0 + warp_row0 + (r / 2) * 16 + g + 8 * (r % 2), e0 = 2 * (r % 2);
        if (row >= Tq) continue;
        T *o_row = o + row * p.o_stride.row;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn)
            *reinterpret_cast<uint32_t *>(o_row + dn * 8 + 2 * t) =
                E::pack(acc[r / 2][dn][e0] * inv, acc[r / 2][dn][e0 + 1] * inv);
        // §8: +inf for a row that sees no key, so that the backward's P = exp(s - lse) is 0 there
        if (t == 0) p.lse[static_cast<int64_t>(bh) * Tq + row] = l > 0.f ? (m_run[r] + log2f(l)) * LN2 : INFINITY;
    }
}

template <typename T, int D, int BN>
cudaError_t launch_key_tiles(const AttentionParams &p) {
    constexpr int smem = forward_smem_bytes<D, BN>();
    auto kernel = forward_kernel<T, D, BN>;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    const dim3 grid((p.seqlen_q + FWD_BLOCK_M - 1) / FWD_BLOCK_M, p.batch * p.heads_q);
    kernel<<<grid, FWD_THREADS, smem, p.stream>>>(p);
    return cudaGetLastError();
}

// The larger key tile where an SM holds two blocks of it (sm_90's 228 KiB of shared memory, and sm_80's 164 at D =
// 64: one block alone on an SM would leave 4 warps to hide each other's latencies), else the smaller
template <typename T, int D>
cudaError_t launch_forward(const AttentionParams &p) {
    constexpr int LARGE = D == 64 ? 128 : 64, SMALL = LARGE / 2;
    constexpr int reserved = 1024;  // per block, by the driver (sm_80 and newer)
    const bool two_fit = shared_memory(p).per_sm >= 2 * (forward_smem_bytes<D, LARGE>() + reserved);
    return two_fit ? launch_key_tiles<T, D, LARGE>(p) : launch_key_tiles<T, D, SMALL>(p);
}

}  // namespace

cudaError_t flash_forward(const AttentionParams &p) {
    if (p.bf16) return p.head_dim == 64 ? launch_forward<__nv_bfloat16, 64>(p) : launch_forward<__nv_bfloat16, 128>(p);
    return p.head_dim == 64 ? launch_forward<__half, 64>(p) : launch_forward<__half, 128>(p);
}

}  // namespace nanoflash_cuda
