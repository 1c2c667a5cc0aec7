// What the host side (binding.cpp) hands the kernels (flash_forward.cu, flash_backward.cu): pointers, shapes and
// strides of one attention call. Plain C++ (no device code), so that binding.cpp, compiled by the host compiler, can
// include it too.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace nanoflash_cuda {

// Strides are in elements. The last dim of every tensor is contiguous (stride 1) and every other stride is a multiple
// of 8 elements, with 16-byte aligned data pointers: the Python wrapper (attention/cuda/__init__.py) .contiguous()s a
// tensor that is not so, because the kernels copy rows in 16-byte pieces (cp.async, §9 of docs/flash_attention.md).
struct Strides {
    int64_t batch, head, row;
};

struct AttentionParams {
    // (B, Hq, Tq, D) queries, output, dO, dQ; (B, Hkv, Tk, D) keys, values, dK, dV; (B, Hq, Tq) float32 lse, Delta
    const void *q, *k, *v;
    void *o;
    float *lse;  // natural log-sum-exp of each query row (§4); +inf for a row that sees no key (§8)
    Strides q_stride, k_stride, v_stride, o_stride;  // lse: contiguous (B, Hq, Tq)

    // backward only
    const void *dout;
    Strides do_stride;
    float *delta;     // (B, Hq, Tq) rowsum(dO * O) (§5)
    float *dq_accum;  // (B, Hq, Tq, D) contiguous float32 (sm_90: dq_chunk's order), zeroed by delta_kernel
    void *dq;         // (B, Hq, Tq, D) contiguous, as dq_accum
    void *dk, *dv;
    Strides dk_stride, dv_stride;

    int batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
    float scale;  // softmax scale (1/sqrt(D) unless the caller gave another)
    bool causal;  // bottom-right aligned: query i sees keys j <= i + Tk - Tq (§6)
    bool bf16;    // bfloat16 inputs, else float16
    cudaStream_t stream;
    // shared memory the launches choose tiles by, bytes (launch_forward, launch_backward): 0 for the device's own;
    // less makes this GPU run the tiles of one that has less (the tests, through attention.cuda.shared_memory_limit)
    int smem_limit;
};

// The shared memory a block may take (the opt-in maximum) and an SM holds, bytes, each capped at p.smem_limit if set
struct SharedMemory {
    int per_block, per_sm;
};

inline SharedMemory shared_memory(const AttentionParams &p) {
    int device = 0;
    SharedMemory smem{};
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&smem.per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cudaDeviceGetAttribute(&smem.per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    if (p.smem_limit > 0) {
        smem.per_block = smem.per_block < p.smem_limit ? smem.per_block : p.smem_limit;
        smem.per_sm = smem.per_sm < p.smem_limit ? smem.per_sm : p.smem_limit;
    }
    return smem;
}

// Both return cudaSuccess or the launch error; they check nothing the binding has checked (dtype, head dim, strides).
cudaError_t flash_forward(const AttentionParams &params);
cudaError_t flash_backward(const AttentionParams &params);

}  // namespace nanoflash_cuda
