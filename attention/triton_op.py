"""The Triton FlashAttention kernels (triton_flash.py) as PyTorch operators.

nanoflash::flash_attn_fwd and nanoflash::flash_attn_bwd are torch.library custom ops with fake
(meta) implementations, so torch.compile(fullgraph=True) traces straight through them without a
graph break; FlashAttentionFunction wires the backward op to the forward for autograd.

    from attention.triton_op import flash_attention
    y = flash_attention(q, k, v, causal=True)   # q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D)
"""
import torch

from . import triton_flash
from .validate import check_qkv

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # tl.dot needs >= 16; a 256-wide tile is the most that fits on chip


@torch.library.custom_op("nanoflash::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_flash.forward(q, k, v, causal, scale)


@flash_attn_fwd.register_fake
def _flash_attn_fwd_fake(q, k, v, causal, scale):
    # the same allocation as the real op, so compiled graphs see the real (B, T, H, D) strides
    B, Hq, Tq, D = q.shape
    return triton_flash.empty_bthd(B, Hq, Tq, D, q), q.new_empty(B, Hq, Tq, dtype=torch.float32)


@torch.library.custom_op("nanoflash::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return triton_flash.backward(do, q, k, v, o, lse, causal, scale)


@flash_attn_bwd.register_fake
def _flash_attn_bwd_fake(do, q, k, v, o, lse, causal, scale):
    return tuple(triton_flash.empty_bthd(*t.shape, t) for t in (q, k, v))


def _fwd(q, k, v, causal: bool, scale: float):
    # Under torch.compile the custom op keeps the kernel one opaque node with a fake impl. In eager
    # mode the launcher is called directly: a custom op call passes through ~8 Python frames
    # (autograd fallback, redispatch, dynamo guard), and at GPT-2's shape on the H200 box the host
    # time of those layers exceeded the kernels' GPU time (benchmarks/launch_overhead.py).
    if torch.compiler.is_compiling():
        return flash_attn_fwd(q, k, v, causal, scale)
    return triton_flash.forward(q, k, v, causal, scale)


def _bwd(do, q, k, v, o, lse, causal: bool, scale: float):
    if torch.compiler.is_compiling():  # as in _fwd
        return flash_attn_bwd(do, q, k, v, o, lse, causal, scale)
    return triton_flash.backward(do, q, k, v, o, lse, causal, scale)


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd for the kernels; torch.compile traces through it to the custom ops."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        o, lse = _fwd(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)  # the log-sum-exp is returned for inspection, not for training
        ctx.set_materialize_grads(False)  # lse never gets a gradient: don't allocate zeros for it
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _bwd(do, q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def _check_kernel_support(q: torch.Tensor) -> None:
    """What the Triton kernel adds to check_qkv's checks (dtype, head dim, device)."""
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(
            f"the triton attention kernel supports float16, bfloat16 and float32, got {q.dtype}; "
            "cast q, k, v with .float() or use backend='naive' for float64"
        )
    D = q.shape[-1]
    if not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(
            f"the triton attention kernel supports head_dim {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {D}; "
            "change n_embd / n_head, or use backend='sdpa' for this head size"
        )
    if q.device.type != "cuda" and not triton_flash.INTERPRET:
        raise ValueError(
            f"the triton attention kernel runs on CUDA tensors, got device {q.device}; move tensors to a "
            "CUDA device or set TRITON_INTERPRET=1 to run Triton's CPU interpreter"
        )


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
):
    """FlashAttention-2: softmax(q k^T * scale) v without materialising the (Tq, Tk) scores.

    q: (B, Hq, Tq, D); k, v: (B, Hkv, Tk, D), Hq a multiple of Hkv (query head h reads kv head
    h // (Hq // Hkv)); any strides. float16/bfloat16/float32, 16 <= D <= 256.
    causal: query i sees keys <= i + Tk - Tq (bottom-right aligned); a query that sees no key
    gets output 0 and zero gradients.
    scale: defaults to 1/sqrt(D).
    Returns out (B, Hq, Tq, D) in q's dtype, stored (B, Tq, Hq, D) so out.transpose(1, 2) is
    contiguous; with return_lse also lse (B, Hq, Tq) float32, the natural-log log-sum-exp of
    each row's scaled scores (+inf for a row that sees no key; not differentiable).
    """
    check_qkv(q, k, v, scale)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return triton_attention(q, k, v, causal, float(scale), return_lse)


def triton_attention(q, k, v, causal: bool, scale: float, return_lse: bool = False):
    """flash_attention for inputs that already passed check_qkv (the registry checks them once)."""
    _check_kernel_support(q)
    out, lse = FlashAttentionFunction.apply(q, k, v, causal, scale)
    return (out, lse) if return_lse else out
