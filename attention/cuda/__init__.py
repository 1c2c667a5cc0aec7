"""backend="cuda": FlashAttention-2 written in CUDA C++ (issue 48), beside the Triton kernels of attention/flash.

    from attention.cuda import cuda_attention
    y = cuda_attention(q, k, v, causal=True)   # or attention(q, k, v, backend="cuda"), train.py --attn=cuda

Takes (B, Hq, Tq, D) queries and (B, Hkv, Tk, D) keys and values, float16 or bfloat16, head dim 64 or 128, Hq a
multiple of Hkv (GQA), any Tq and Tk, causal (bottom-right aligned: query i sees keys j <= i + Tk - Tq, a query that
sees none returns 0) or not, any scale. No windows, documents, block masks or FlashAttention's extra terms, no varlen.

Design (the kernels' comments cite docs/flash_attention.md by section):
- flash_forward.cu: a block of 4 warps per 128 query rows, each warp two tiles of 16 rows; key tiles of 128 rows at
  D = 64, 64 at D = 128 (half that where an SM cannot hold two blocks of them), K and V double buffered in shared
  memory with cp.async; S = Q K^T and O += P V on tensor cores (mma.sync m16n8k16, fp32 accumulation) from operands
  read with ldmatrix; the online softmax in base 2; the log-sum-exp saved per row.
- flash_backward.cu: a Delta = rowsum(dO * O) pre-pass; then a block of 8 warps per 128 keys of one kv head that
  walks the query tiles (128 rows at D = 64, 64 at D = 128; half that where a block has less than 162 KiB of shared
  memory) of every query head of its group, recomputing P from the log-sum-exp; each warp takes 32 keys by half the
  queries for S^T and dP^T and by half of D for dK and dV (in registers), P^T and dS^T passing through shared memory;
  dQ is added with float32 atomics into a scratch buffer, then scaled and cast (one product per tile pair less than a
  separate dQ pass; not bitwise deterministic).
- flash_common.cuh: shared-memory tiles in 16-byte chunks XOR-swizzled by row (chunk ^ row % 8), so ldmatrix and
  cp.async hit distinct banks, each lane's address computed once and moved by block_at; the mma, ldmatrix and
  cp.async wrappers (inline PTX).
- build.py: compiled on first use with nvcc and ninja for the GPU in use, cached by torch's extension cache.
- binding.cpp: the inputs laid out as the kernels read them, the outputs allocated, the launches; an eager call's
  forward and backward as one C++ autograd node.
- Here: the kernels as operators, torch.ops.nanoflash.cuda_attention_fwd and _bwd, with fakes, so torch.compile keeps
  them in its graph; the forward carries its autograd.
"""
import contextlib

import torch

from ..flash.ops import define_op
from .build import CudaBackendUnavailable, check_cuda_device, load_extension

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)

__all__ = ["CudaBackendUnavailable", "check_cuda_device", "cuda_attention", "shared_memory_limit"]


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


def _forward(q, k, v, causal: bool, scale: float):
    out, lse = load_extension(q.device).forward(q, k, v, causal, scale)
    return out, lse


def _forward_fake(q, k, v, causal: bool, scale: float):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)  # out (B, Hq, Tq, D), lse (B, Hq, Tq)


def _backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    dq, dk, dv = load_extension(q.device).backward(dout, q, k, v, out, lse, causal, scale)
    return dq, dk, dv


def _backward_fake(dout, q, k, v, out, lse, causal: bool, scale: float):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_for_backward(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.causal, ctx.scale = causal, scale


def _gradients(ctx, dout, _dlse):
    """§5's backward from the saved log-sum-exp (the lse output is for the backward only: its gradient is ignored)."""
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = cuda_attention_bwd(dout, q, k, v, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


# The kernels as operators (torch.ops.nanoflash.cuda_attention_*), each with a fake that gives its outputs' shapes, so
# that torch.compile(fullgraph=True) keeps them in the graph; the forward carries its autograd. Eager calls take
# binding.cpp's `attention` instead: the same kernels under one C++ autograd node, where the operators' Python
# autograd would add a Python call to the forward and another to the backward.
cuda_attention_bwd = define_op("cuda_attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                               "bool causal, float scale) -> (Tensor, Tensor, Tensor)", _backward, _backward_fake)
cuda_attention_fwd = define_op("cuda_attention_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale) "
                               "-> (Tensor, Tensor)", _forward, _forward_fake, _gradients, _save_for_backward)


def cuda_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                   scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v with the CUDA kernels: q (B, Hq, Tq, D), k, v (B, Hkv, Tk, D) -> (B, Hq, Tq, D).
    scale defaults to 1/sqrt(D). The first call of a process builds (or loads from torch's cache) the extension."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if torch.compiler.is_compiling():  # the device query does not trace; compiled, binding.cpp's checks refuse
        return cuda_attention_fwd(q, k, v, bool(causal), float(scale))[0]
    check_cuda_support(q)
    return load_extension(q.device).attention(q, k, v, bool(causal), float(scale))


@contextlib.contextmanager
def shared_memory_limit(nbytes: int, device: torch.device | str = "cuda"):
    """Within it, the kernels choose their tiles as on a GPU with at most nbytes of shared memory per block and per
    SM: the tiles of an A100 (164 KiB) or an RTX 30/40 (100 KiB) on this one, which the tests check against float64
    there (flash_forward.cu's key tiles and flash_backward.cu's query steps are chosen by shared memory)."""
    module = load_extension(torch.device(device))
    module.set_shared_memory_limit(nbytes)
    try:
        yield
    finally:
        module.set_shared_memory_limit(0)
