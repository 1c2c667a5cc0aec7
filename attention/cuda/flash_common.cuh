// Building blocks shared by flash_forward.cu and flash_backward.cu: tensor-core products (mma.sync m16n8k16),
// shared-memory tiles in a bank-conflict-free swizzled layout read with ldmatrix, asynchronous global->shared copies
// (cp.async) and the fp16/bf16 packing. Section numbers (§N) refer to docs/flash_attention.md.
//
// Fragment layouts of mma.sync.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), for lane = 32-thread lane id,
// g = lane / 4 (the "group") and t = lane % 4 (the thread in the group):
//   A (16 x 16, row-major): a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..2t+1], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]
//   B (16 x 8, k x n):      b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   C (16 x 8, fp32):       c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1]
// Two C tiles side by side (16 x 16) hold exactly the values of one A fragment: that is how a score tile computed by
// one product becomes, after the softmax, the left operand of the next product without leaving registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <climits>
#include <cstdint>

#include "flash_params.h"

namespace nanoflash_cuda {

constexpr float LOG2E = 1.4426950408889634f;  // §8: exp(x) = exp2(x * log2(e))
constexpr float LN2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------------------------------------------------
// fp16 / bf16: two values in one 32-bit register, and the tensor-core product of each

template <typename T>
struct Element;

template <>
struct Element<__half> {
    // explicit conversions: torch's extension build defines __CUDA_NO_HALF_CONVERSIONS__ (no implicit ones)
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    }
    // C += A B, fp16 inputs, fp32 accumulation (§8 precision)
    static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

template <>
struct Element<__nv_bfloat16> {
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    }
    static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// A 16 x 16 product tile as two mma.sync: C0 += A B[.., 0:8] and C1 += A B[.., 8:16], b holding the two 16 x 8 B
// fragments one ldmatrix_x4 reads (b[0..1] and b[2..3])
template <typename T>
__device__ __forceinline__ void mma_16x16(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[4]) {
    Element<T>::mma(c0, a, b[0], b[1]);
    Element<T>::mma(c1, a, b[2], b[3]);
}

// Two C tiles side by side (c0 the columns 0-7, c1 the columns 8-15) as the A fragment of the next product, rounded
// to T (the layouts above)
template <typename T>
__device__ __forceinline__ void a_from_c(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = Element<T>::pack(c0[0], c0[1]);
    a[1] = Element<T>::pack(c0[2], c0[3]);
    a[2] = Element<T>::pack(c1[0], c1[1]);
    a[3] = Element<T>::pack(c1[2], c1[3]);
}

// ---------------------------------------------------------------------------------------------------------------------
// Shared-memory tiles: ROWS x COLS elements, row-major, each row cut in 16-byte chunks of 8 elements whose order is
// XOR-swizzled by the row number.
//
// Why: shared memory has 32 banks of 4 bytes; one ldmatrix phase reads 8 rows x 16 bytes at the same column. With
// rows 128 or 256 bytes long every row starts in bank 0, so unswizzled those 8 reads would all fall in the same 4
// banks (an 8-way conflict). Storing logical chunk c of row r at chunk c ^ (r % 8) spreads 8 consecutive rows over 8
// different chunks = all 32 banks. A 64-byte row (4 chunks; two rows per 128-byte bank line) XORs with (r / 2) % 4
// instead, which again gives 8 distinct 16-byte bank groups for 8 consecutive rows. Writers (cp.async, 16 bytes per
// thread, or 4-byte fragment stores) hit distinct banks the same way.
template <int COLS>
__device__ __forceinline__ int swizzle(int row, int col) {
    constexpr int CHUNKS = COLS / 8;
    static_assert(COLS % 32 == 0, "rows of 4, 8, 16... 16-byte chunks");
    int chunk = col / 8;
    if constexpr (CHUNKS >= 8) {
        chunk ^= row & 7;
    } else {
        chunk ^= (row / (8 / CHUNKS)) & (CHUNKS - 1);
    }
    return row * COLS + chunk * 8 + (col % 8);
}

__device__ __forceinline__ uint32_t smem_address(const void *ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// ldmatrix: four 8x8 matrices of 16-bit elements; lane L gives the address of row L % 8 of matrix L / 8 and receives
// in r[j] its part of matrix j (in the C-fragment layout above: row g, columns 2t..2t+1). .trans transposes each
// 8x8 matrix on the way, which turns a k x n row-major tile into the B operand (n-major) without a transposed copy.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// Where lane L points, for the two ways a 16 x 16 block at (row0, col0) of a tile is read with one ldmatrix_x4:
//  * a_pattern: matrices (rows +0, cols +0), (+8, +0), (+0, +8), (+8, +8) -> r = an A fragment (no .trans), or with
//    .trans of a k x n tile the B fragments of two n-blocks of 8: (r[0], r[1]) for cols +0..7, (r[2], r[3]) +8..15;
//  * b_pattern: matrices (+0, +0), (+0, +8), (+8, +0), (+8, +8) -> of an n x k tile (B transposed, e.g. K for Q K^T)
//    the B fragments of two n-blocks: (r[0], r[1]) rows +0..7, (r[2], r[3]) rows +8..15; with .trans of a k x m tile
//    (A transposed) the A fragment of A = tile^T.
template <int COLS>
__device__ __forceinline__ uint32_t a_pattern(const void *tile, int row0, int col0, int lane) {
    const int row = row0 + (lane & 15), col = col0 + (lane >> 4) * 8;
    return smem_address(static_cast<const uint16_t *>(tile) + swizzle<COLS>(row, col));
}

template <int COLS>
__device__ __forceinline__ uint32_t b_pattern(const void *tile, int row0, int col0, int lane) {
    const int row = row0 + (lane & 7) + (lane >> 4) * 8, col = col0 + ((lane >> 3) & 1) * 8;
    return smem_address(static_cast<const uint16_t *>(tile) + swizzle<COLS>(row, col));
}

// Where a block lies from one whose address is known: block (row0 + row, col0 + col) of a COLS-wide swizzled tile,
// from a lane's address `at` of block (row0, col0) (a_pattern, b_pattern) or its byte offset in the tile. The
// address's chunk field (the bits of a 16-byte chunk within a row) holds the swizzled chunk (col0 / 8 + the lane's
// own chunk) ^ f(row), and moving the block XORs it with col / 8 and adds whole rows above it: one LOP3, and an add
// the load takes as its offset, where recomputing the swizzle from row and column takes several integer instructions
// per fragment, which crowd the tensor products' issue slots (perf_notes §14). It holds where
//   - the tile starts at a multiple of its row length (2 * COLS bytes) in shared memory (the kernels' tiles start at
//     multiples of 4 KiB from a 1 KiB-aligned buffer), so the chunk field of the address is the tile offset's;
//   - row is a multiple of 8: f, a function of the row's last three bits, is the same for both blocks;
//   - col is a multiple of 8 and shares no chunk bit with col0 or the lane's own chunk (e.g. col0 = a warp's half of D,
//     col below that half; the patterns' lanes take chunk bit 0, so their col is a multiple of 16): then
//     (col0 / 8 + own + col / 8) ^ f = (col0 / 8 + own) ^ f ^ col / 8.
template <int COLS>
__device__ __forceinline__ uint32_t block_at(uint32_t at, int row, int col) {
    return (at ^ static_cast<uint32_t>(col * 2)) + static_cast<uint32_t>(row * COLS * 2);
}

// ---------------------------------------------------------------------------------------------------------------------
// cp.async: global -> shared copies that run while the warps compute (double buffering: §9's num_stages = 2)

// 16 bytes from src to dst; with valid false nothing is read and dst gets zeros (a row past the end of the sequence).
__device__ __forceinline__ void cp_async_16(void *dst, const void *src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
                 "r"(src_bytes));
}

// 4 bytes (one float) from src to dst, or a zero where valid is false: a row's lse or Delta (cp.async.cg copies 16
// bytes only, .ca any of 4, 8 and 16).
__device__ __forceinline__ void cp_async_4(void *dst, const void *src, bool valid) {
    const int src_bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(dst)), "l"(src),
                 "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// wait until at most N of this thread's committed copy groups are still in flight
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Rows [row0, row0 + ROWS) of a (T, COLS) matrix whose rows are row_stride elements apart, into a swizzled ROWS x
// COLS tile; rows >= seqlen become zeros (§6 ragged last tile). Issued by all THREADS threads, 16 bytes each: a thread
// copies one 16-byte column of the rows tid / CHUNKS + i * ROW_STEP, which share the swizzle (it depends on row % 8),
// so once its first chunk's addresses are known every other chunk is a fixed step away in both memories, one 64-bit
// add and the copy, where working out row, column, swizzle and source per chunk took several times that (perf_notes
// §14); and only a tile that reaches past seqlen tests its rows.
template <typename T, int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void load_tile_async(T *tile, const T *base, int64_t row_stride, int row0, int seqlen,
                                                int tid) {
    constexpr int CHUNKS = COLS / 8, ROW_STEP = THREADS / CHUNKS, PER_THREAD = ROWS / ROW_STEP;
    static_assert(THREADS % CHUNKS == 0 && ROW_STEP % 8 == 0 && ROWS % ROW_STEP == 0,
                  "each thread's chunks: one column, rows ROW_STEP (a multiple of 8) apart");
    const int row = tid / CHUNKS, col = (tid % CHUNKS) * 8;
    const T *src = base + (row0 + row) * row_stride + col;
    const int64_t step = ROW_STEP * row_stride;
    T *dst = tile + swizzle<COLS>(row, col);
    if (row0 + ROWS <= seqlen) {
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) cp_async_16(dst + i * ROW_STEP * COLS, src + i * step, true);
    } else {
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const bool valid = row0 + row + i * ROW_STEP < seqlen;
            cp_async_16(dst + i * ROW_STEP * COLS, valid ? src + i * step : base, valid);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Bulk reductions (sm_90 and newer): the copy engine adds a contiguous run of floats from shared memory into global
// memory, one instruction for the run, where atomics take one per pair of floats and thread. A thread's reductions
// form groups as its cp.async copies do; their shared memory may be written again once the group has been read.

// dst[i] += src[i] for bytes / 4 floats (bytes a multiple of 16, both addresses 16-byte aligned), asynchronously
__device__ __forceinline__ void bulk_add(float *dst, const float *src, int bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
                 "r"(smem_address(src)), "r"(bytes)
                 : "memory");
#else
    __trap();  // launch_backward takes this path on sm_90 and newer only
#endif
}

__device__ __forceinline__ void bulk_commit() {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// wait until this thread's reductions have all read their shared memory (wait_group.read), or with DONE finished
template <bool DONE>
__device__ __forceinline__ void bulk_wait() {
#if __CUDA_ARCH__ >= 900
    if constexpr (DONE) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    else asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}

// this thread's ordinary shared-memory stores, visible to the copy engine (the async proxy) after the next barrier
__device__ __forceinline__ void fence_for_bulk() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------------------------------------
// math

// 2^x in one instruction (§8 exp2). ex2.approx(-inf) = +0, which masked scores rely on. Called by name instead of
// compiling with --use_fast_math, which would also change every division and square root of the kernels.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// the 4 threads of a group (t = 0..3) hold parts of the same two rows of a C fragment: reduce across them
__device__ __forceinline__ float group_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float group_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// §6: the bottom-right aligned causal rule, the one place it is written for these kernels: query i sees key j when
// j < Tk and, causal, j <= i + Tk - Tq. Asked once per row of a tile, as a bound its elements are compared with: the
// forward's rows are queries, the backward's keys (a bound per element, recomputed from row and column, took
// registers enough to spill the larger tiles).
__device__ __forceinline__ int last_visible_key(int query, int seqlen_q, int seqlen_k, bool causal) {
    return causal ? min(seqlen_k - 1, query + seqlen_k - seqlen_q) : seqlen_k - 1;
}

// the first query that sees key; past every query, padding rows included, for a key >= Tk, which none sees
__device__ __forceinline__ int first_visible_query(int key, int seqlen_q, int seqlen_k, bool causal) {
    return key >= seqlen_k ? INT_MAX : causal ? key - (seqlen_k - seqlen_q) : 0;
}

}  // namespace nanoflash_cuda
