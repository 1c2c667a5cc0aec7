// The PyTorch side of the CUDA kernels: lays the inputs out as the kernels read them, checks the rest of what they
// assume, allocates the outputs, fills AttentionParams and launches on the current stream. forward and backward are
// the operators' implementations (attention/cuda/__init__.py: torch.ops.nanoflash.cuda_attention_*, which
// torch.compile keeps in its graphs); `attention` is an eager call's whole path, forward and backward in one C++
// autograd node, with no Python between the autograd engine and the kernels. It includes what it uses, not
// torch/extension.h (all of libtorch's C++ API): the first call's build waits for this file to compile.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>  // torch::autograd::Function
#include <torch/csrc/utils/pybind.h>              // PYBIND11_MODULE and at::Tensor's conversions

#include "flash_params.h"

namespace {

using nanoflash_cuda::AttentionParams;
using nanoflash_cuda::Strides;

int shared_memory_limit = 0;  // AttentionParams::smem_limit of every call (set_shared_memory_limit)

Strides strides_of(const at::Tensor &t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// t as the kernels read it: a contiguous last dim, the other strides multiples of 8 elements and a 16-byte aligned
// start (rows are copied in 16-byte pieces). A model's q, k, v views of one projection already are, and so is the
// gradient of a head-merging transpose; other tensors are copied.
at::Tensor kernel_layout(const at::Tensor &t, const char *name) {
    TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
    TORCH_CHECK(t.dim() == 4, name, " must be (B, H, T, D)");
    auto fits = [](const at::Tensor &x) {
        return x.stride(3) == 1 && x.stride(0) % 8 == 0 && x.stride(1) % 8 == 0 && x.stride(2) % 8 == 0 &&
               reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
    };
    if (fits(t)) return t;
    at::Tensor c = t.contiguous();
    return fits(c) ? c : c.clone();  // contiguous but starting off 16 bytes (a view at an odd offset)
}

// q, k, v in kernel_layout
AttentionParams make_params(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, bool causal, double scale) {
    const auto dtype = q.scalar_type();
    TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "the cuda kernels take float16 or bfloat16");
    TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, "q, k, v must have one dtype");
    const int64_t D = q.size(3);
    TORCH_CHECK(D == 64 || D == 128, "the cuda kernels take head dim 64 or 128");
    TORCH_CHECK(k.size(3) == D && v.size(3) == D, "q, k, v must have one head dim");
    TORCH_CHECK(k.size(0) == q.size(0) && v.sizes() == k.sizes(), "k and v must be (B, Hkv, Tk, D) with q's B");
    TORCH_CHECK(q.size(1) % k.size(1) == 0, "Hq must be a multiple of Hkv");
    TORCH_CHECK(q.size(0) * q.size(1) <= 65535 && k.size(0) * k.size(1) <= 65535, "B * H must be at most 65535");

    AttentionParams p{};
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.q_stride = strides_of(q);
    p.k_stride = strides_of(k);
    p.v_stride = strides_of(v);
    p.batch = static_cast<int>(q.size(0));
    p.heads_q = static_cast<int>(q.size(1));
    p.heads_kv = static_cast<int>(k.size(1));
    p.seqlen_q = static_cast<int>(q.size(2));
    p.seqlen_k = static_cast<int>(k.size(2));
    p.head_dim = static_cast<int>(D);
    p.scale = static_cast<float>(scale);
    p.causal = causal;
    p.bf16 = dtype == at::kBFloat16;
    p.stream = c10::cuda::getCurrentCUDAStream().stream();
    p.smem_limit = shared_memory_limit;
    return p;
}

// -> (out (B, Hq, Tq, D), lse (B, Hq, Tq) float32 natural log, +inf for a row that sees no key)
std::vector<at::Tensor> forward(const at::Tensor &q_in, const at::Tensor &k_in, const at::Tensor &v_in, bool causal,
                                double scale) {
    const at::Tensor q = kernel_layout(q_in, "q"), k = kernel_layout(k_in, "k"), v = kernel_layout(v_in, "v");
    const c10::cuda::CUDAGuard guard(q.device());
    AttentionParams p = make_params(q, k, v, causal, scale);
    at::Tensor out = at::empty(q.sizes(), q.options());
    at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
    p.o = out.data_ptr();
    p.o_stride = strides_of(out);
    p.lse = lse.data_ptr<float>();
    if (q.numel() > 0 && k.size(2) > 0) {
        const cudaError_t err = nanoflash_cuda::flash_forward(p);
        TORCH_CHECK(err == cudaSuccess, "cuda attention forward: ", cudaGetErrorString(err));
    } else {
        out.zero_();
        lse.fill_(std::numeric_limits<float>::infinity());
    }
    return {out, lse};
}

// -> (dq, dk, dv) shaped like q, k, v
std::vector<at::Tensor> backward(const at::Tensor &dout_in, const at::Tensor &q_in, const at::Tensor &k_in,
                                 const at::Tensor &v_in, const at::Tensor &out_in, const at::Tensor &lse, bool causal,
                                 double scale) {
    const at::Tensor q = kernel_layout(q_in, "q"), k = kernel_layout(k_in, "k"), v = kernel_layout(v_in, "v");
    const at::Tensor dout = kernel_layout(dout_in, "dout"), out = kernel_layout(out_in, "out");
    const c10::cuda::CUDAGuard guard(q.device());
    AttentionParams p = make_params(q, k, v, causal, scale);
    TORCH_CHECK(dout.sizes() == q.sizes() && dout.scalar_type() == q.scalar_type(), "dout must be like q");
    TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat, "lse must be contiguous float32");
    at::Tensor dq = at::empty(q.sizes(), q.options());
    at::Tensor dk = at::empty(k.sizes(), k.options());
    at::Tensor dv = at::empty(v.sizes(), v.options());
    if (q.numel() == 0 || k.size(2) == 0) return {dq.zero_(), dk.zero_(), dv.zero_()};
    at::Tensor delta = at::empty(lse.sizes(), lse.options());
    at::Tensor dq_accum = at::empty(q.sizes(), q.options().dtype(at::kFloat));  // zeroed by delta_kernel
    p.o = const_cast<void *>(out.data_ptr());
    p.o_stride = strides_of(out);
    p.lse = const_cast<float *>(lse.data_ptr<float>());
    p.dout = dout.data_ptr();
    p.do_stride = strides_of(dout);
    p.delta = delta.data_ptr<float>();
    p.dq_accum = dq_accum.data_ptr<float>();
    p.dq = dq.data_ptr();
    p.dk = dk.data_ptr();
    p.dv = dv.data_ptr();
    p.dk_stride = strides_of(dk);
    p.dv_stride = strides_of(dv);
    const cudaError_t err = nanoflash_cuda::flash_backward(p);
    TORCH_CHECK(err == cudaSuccess, "cuda attention backward: ", cudaGetErrorString(err));
    return {dq, dk, dv};
}

// An eager call's autograd node: forward saves q, k, v as the kernels read them (one copy serves both passes), out
// and lse; backward runs on the autograd engine's thread with no Python (the operators' autograd, registered from
// Python, costs a Python call each way).
struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &q_in, const at::Tensor &k_in,
                              const at::Tensor &v_in, bool causal, double scale) {
        const at::Tensor q = kernel_layout(q_in, "q"), k = kernel_layout(k_in, "k"), v = kernel_layout(v_in, "v");
        std::vector<at::Tensor> out_lse = ::forward(q, k, v, causal, scale);
        ctx->save_for_backward({q, k, v, out_lse[0], out_lse[1]});
        ctx->saved_data["causal"] = causal;
        ctx->saved_data["scale"] = scale;
        return out_lse[0];
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        const auto saved = ctx->get_saved_variables();  // q, k, v, out, lse
        std::vector<at::Tensor> dqkv = ::backward(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                                                  ctx->saved_data["causal"].toBool(),
                                                  ctx->saved_data["scale"].toDouble());
        return {dqkv[0], dqkv[1], dqkv[2], at::Tensor(), at::Tensor()};  // causal and scale take none
    }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "nanoflash's CUDA FlashAttention-2 kernels (attention/cuda)";
    m.def("forward", &forward, "attention forward -> (out, lse)");
    m.def("backward", &backward, "attention backward -> (dq, dk, dv)");
    m.def(
        "attention",
        [](const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, bool causal, double scale) {
            return AttentionFunction::apply(q, k, v, causal, scale);
        },
        "an eager call: out, with its backward in one C++ autograd node");
    m.def(
        "kernel_layout", [](const at::Tensor &t) { return kernel_layout(t, "t"); },
        "t as the kernels read it: t itself where they can, else a copy");
    m.def(
        "set_shared_memory_limit", [](int bytes) { shared_memory_limit = bytes; },
        "choose tiles as if the GPU had at most this much shared memory per block and per SM (0: its own)");
}
