"""backend="cuda": FlashAttention-2 written in CUDA C++ (issue 48), beside the Triton kernels of attention/flash.

    from attention.cuda import cuda_attention
    y = cuda_attention(q, k, v, causal=True)   # or attention(q, k, v, backend="cuda"), train.py --attn=cuda

Takes (B, Hq, Tq, D) queries and (B, Hkv, Tk, D) keys and values, float16 or bfloat16, head dim 64 or 128, Hq a
multiple of Hkv (GQA), any Tq and Tk, causal (bottom-right aligned: query i sees keys j <= i + Tk - Tq, a query that
sees none returns 0) or not, any scale. No windows, documents, block masks or FlashAttention's extra terms, no varlen.

Design (the kernels' comments cite docs/flash_attention.md by section):
- flash_forward.cu: a block of 4 warps per 64 query rows, each warp 16 rows; key tiles of 64 rows, K and V double
  buffered in shared memory with cp.async; S = Q K^T and O += P V on tensor cores (mma.sync m16n8k16, fp32
  accumulation) from operands read with ldmatrix; the online softmax in base 2; the log-sum-exp saved per row.
- flash_backward.cu: a Delta = rowsum(dO * O) pre-pass; then a block per 64 keys of one kv head that walks the query
  tiles (64 rows at D = 64, 32 at D = 128) of every query head of its group, recomputing P from the log-sum-exp, with
  dK and dV in registers; dQ is added with float32 atomics into a scratch buffer, then scaled and cast (one product
  per tile pair less than a separate dQ pass; not bitwise deterministic).
- flash_common.cuh: shared-memory tiles in 16-byte chunks XOR-swizzled by row (chunk ^ row % 8), so ldmatrix and
  cp.async hit distinct banks; the mma, ldmatrix and cp.async wrappers (inline PTX).
- build.py: compiled on first use with nvcc and ninja for the GPU in use, cached by torch's extension cache.
"""
import torch

from .build import CudaBackendUnavailable, check_cuda_device, load_extension

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)

__all__ = ["CudaBackendUnavailable", "check_cuda_device", "cuda_attention"]


def check_cuda_support(q: torch.Tensor) -> None:
    """What the kernels take besides inputs.check_qkv's checks: the device (and the tools to build for it), dtype,
    head dim. One-line errors."""
    check_cuda_device(q.device)
    if q.dtype not in DTYPES:
        raise TypeError(f"the cuda attention kernels take float16 and bfloat16, got {q.dtype}; cast q, k, v (e.g. "
                        "under torch.autocast) or use backend='triton' for float32")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"the cuda attention kernels take head dim 64 or 128, got {q.shape[-1]}; change n_embd / "
                         "n_head, or use backend='triton'")


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """t as the kernels read it: a contiguous last dim, the other strides multiples of 8 elements and a 16-byte
    aligned start (rows are copied in 16-byte pieces). A model's q, k, v views of one projection already are; other
    tensors are copied."""
    def fits(x):
        return x.stride(-1) == 1 and all(s % 8 == 0 for s in x.stride()[:-1]) and x.data_ptr() % 16 == 0

    if fits(t):
        return t
    t = t.contiguous()
    return t if fits(t) else t.clone()  # contiguous but starting off 16 bytes (a view at an odd offset)


class _CudaAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        out, lse = load_extension(q.device).forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = load_extension(q.device).backward(_kernel_layout(dout), q, k, v, out, lse, ctx.causal,
                                                       ctx.scale)
        return dq, dk, dv, None, None


def cuda_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                   scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v with the CUDA kernels: q (B, Hq, Tq, D), k, v (B, Hkv, Tk, D) -> (B, Hq, Tq, D).
    scale defaults to 1/sqrt(D). The first call of a process builds (or loads from torch's cache) the extension."""
    check_cuda_support(q)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q, k, v = (_kernel_layout(t) for t in (q, k, v))
    return _apply(q, k, v, bool(causal), float(scale))


# torch.compile cannot trace into the extension's functions: the call is left out of the graph (a graph break per
# call) rather than failing the compile. (Registering the kernels as torch.library custom ops with fake
# implementations, as attention/flash does for the Triton kernels, would keep them in the graph; not done yet.)
@torch.compiler.disable
def _apply(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    return _CudaAttention.apply(q, k, v, causal, scale)
