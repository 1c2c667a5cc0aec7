"""The Triton FlashAttention kernels (dispatch.py runs them) as PyTorch operators and autograd: the "triton"
backend of attention/registry.py.

Two ways in, one per mode:
- torch.compile: nanoflash::flash_attn_fwd and nanoflash::flash_attn_bwd are operators with fake (meta)
  implementations (ops.py), and the forward's autograd is registered on the operator itself
  (torch.library.register_autograd), so a compiled graph holds plain operator calls. torch.compile(fullgraph=True)
  traces straight through them without a graph break, and AOTAutograd's cache keeps the traced graphs across
  processes; it leaves out graphs that call an autograd.Function, and would trace them again in every process.
- Eager: FlashAttentionFunction runs the launch plans directly (dispatch.py), without the dispatcher's round trips
  through the operators: at small shapes every microsecond of host time per call shows
  (benchmarks/launch_overhead.py).

    from attention.flash.autograd import flash_attention
    y = flash_attention(q, k, v, causal=True)   # q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D)

Block-sparse calls (§10: window, documents, block masks) pass the BlockMask's tensors through the
same ops as optional arguments (dispatch.MaskArgs): operators take tensors and numbers only. So do varlen
calls (§14, attention_varlen): their cu_seqlens and longest lengths (dispatch.Varlen).

q, k, v packed in one (B, T, 3, H, D) tensor (a fused qkv projection's output, attention_qkvpacked)
take PackedFlashAttentionFunction (nanoflash::flash_attn_fwd_qkvpacked compiled), whose backward
(nanoflash::flash_attn_bwd_qkvpacked) writes the three gradients into one tensor of that shape.
"""
import torch

from . import dispatch
from ..inputs import check_qkv, unpack_qkv
from .ops import define_op
from ..block_mask import sequence_spans
from .device import check_triton_support, is_hopper

# The arguments every op takes after (causal, scale): MaskArgs and Varlen flattened into operator types
MASK_SCHEMA = ("Tensor? kv_blocks=None, Tensor? q_blocks=None, Tensor? document_ids=None, Tensor? tile_bits=None, "
               "int window_left=-1, int window_right=-1, int block_size=16, Tensor? spans=None, "
               "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, int max_seqlen_q=0, int max_seqlen_k=0")


def _from_op_args(kv_blocks=None, q_blocks=None, document_ids=None, tile_bits=None, window_left: int = -1,
                  window_right: int = -1, block_size: int = 16, spans=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  max_seqlen_q: int = 0, max_seqlen_k: int = 0):
    """-> (MaskArgs, Varlen or None) from the ops' flat arguments."""
    window = None if (window_left, window_right) == (-1, -1) else (window_left, window_right)
    varlen = None if cu_seqlens_q is None else dispatch.Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return dispatch.MaskArgs(kv_blocks, q_blocks, window, document_ids, tile_bits, block_size, spans), varlen


def _op_args(mask: dispatch.MaskArgs, varlen: dispatch.Varlen | None = None) -> tuple:
    left, right = mask.window or (-1, -1)
    return (mask.kv_blocks, mask.q_blocks, mask.document_ids, mask.tile_bits, left, right, mask.block_size,
            mask.spans, *(varlen or (None, None, 0, 0)))


def _flash_attn_fwd(q, k, v, causal, scale, *mask):
    mask, varlen = _from_op_args(*mask)
    return dispatch.forward(q, k, v, causal, scale, mask, varlen)


def _flash_attn_fwd_fake(q, k, v, causal, scale, *mask):
    # the same allocation as the real op, so compiled graphs see the real (B, T, H, D) strides
    if _from_op_args(*mask)[1] is not None:  # varlen: (total_q, Hq, D) and (Hq, total_q)
        return q.new_empty(q.shape), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    B, Hq, Tq, D = q.shape
    return dispatch.empty_bthd(B, Hq, Tq, D, q), q.new_empty(B, Hq, Tq, dtype=torch.float32)


def _flash_attn_bwd(do, q, k, v, o, lse, causal, scale, *mask):
    mask, varlen = _from_op_args(*mask)
    return dispatch.backward(do, q, k, v, o, lse, causal, scale, mask, varlen=varlen)


def _flash_attn_bwd_fake(do, q, k, v, o, lse, causal, scale, *mask):
    if _from_op_args(*mask)[1] is not None:
        return tuple(t.new_empty(t.shape) for t in (q, k, v))
    return tuple(dispatch.empty_bthd(*t.shape, t) for t in (q, k, v))


flash_attn_bwd = define_op(
    f"flash_attn_bwd(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool causal, float scale, "
    f"{MASK_SCHEMA}) -> (Tensor, Tensor, Tensor)",
    _flash_attn_bwd, _flash_attn_bwd_fake)


def _flash_attn_bwd_qkvpacked(do, qkv, o, lse, causal, scale, *mask):
    return _packed_backward(do, qkv, o, lse, causal, scale, _from_op_args(*mask)[0])


def _flash_attn_bwd_qkvpacked_fake(do, qkv, o, lse, causal, scale, *mask):
    return qkv.new_empty(qkv.shape)


flash_attn_bwd_qkvpacked = define_op(
    f"flash_attn_bwd_qkvpacked(Tensor do, Tensor qkv, Tensor o, Tensor lse, bool causal, float scale, "
    f"{MASK_SCHEMA}) -> Tensor",
    _flash_attn_bwd_qkvpacked, _flash_attn_bwd_qkvpacked_fake)


def _flash_attn_fwd_qkvpacked(qkv, causal, scale, *mask):
    return _flash_attn_fwd(*unpack_qkv(qkv), causal, scale, *mask)


def _flash_attn_fwd_qkvpacked_fake(qkv, causal, scale, *mask):
    return _flash_attn_fwd_fake(*unpack_qkv(qkv), causal, scale, *mask)


# The places of the tensors among the ops' mask arguments (MASK_SCHEMA)
MASK_TENSORS = (0, 1, 2, 3, 7, 8, 9)


def _keep(ctx, tensors: tuple, causal: bool, scale: float, mask: tuple) -> None:
    """An op's autograd context (setup_context): the tensors the backward reads and the mask's, and the numbers."""
    ctx.save_for_backward(*tensors, *(mask[i] for i in MASK_TENSORS))
    ctx.causal, ctx.scale = causal, scale
    ctx.mask_numbers = [None if i in MASK_TENSORS else arg for i, arg in enumerate(mask)]
    ctx.mark_non_differentiable(tensors[-1])  # lse
    ctx.set_materialize_grads(False)


def _kept(ctx, n: int) -> tuple[tuple, list]:
    """-> the first n tensors _keep saved, and the ops' flat mask arguments."""
    saved = ctx.saved_tensors
    mask = list(ctx.mask_numbers)
    for i, t in zip(MASK_TENSORS, saved[n:]):
        mask[i] = t
    return saved[:n], mask


def _fwd_setup(ctx, inputs, output):
    q, k, v, causal, scale, *mask = inputs
    _keep(ctx, (q, k, v, *output), causal, scale, mask)


def _fwd_backward(ctx, do, _dlse):
    (q, k, v, o, lse), mask = _kept(ctx, 5)
    return *flash_attn_bwd(do, q, k, v, o, lse, ctx.causal, ctx.scale, *mask), None, None, *[None] * len(mask)


def _fwd_qkvpacked_setup(ctx, inputs, output):
    qkv, causal, scale, *mask = inputs
    _keep(ctx, (qkv, *output), causal, scale, mask)


def _fwd_qkvpacked_backward(ctx, do, _dlse):
    (qkv, o, lse), mask = _kept(ctx, 3)
    return flash_attn_bwd_qkvpacked(do, qkv, o, lse, ctx.causal, ctx.scale, *mask), None, None, *[None] * len(mask)


# torch.compile's way in (module docstring): the forward ops carry their autograd
flash_attn_fwd = define_op(
    f"flash_attn_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale, {MASK_SCHEMA}) -> (Tensor, Tensor)",
    _flash_attn_fwd, _flash_attn_fwd_fake, _fwd_backward, _fwd_setup)
flash_attn_fwd_qkvpacked = define_op(
    f"flash_attn_fwd_qkvpacked(Tensor qkv, bool causal, float scale, {MASK_SCHEMA}) -> (Tensor, Tensor)",
    _flash_attn_fwd_qkvpacked, _flash_attn_fwd_qkvpacked_fake, _fwd_qkvpacked_backward, _fwd_qkvpacked_setup)


def _packed_backward(do, qkv, o, lse, causal: bool, scale: float, mask: dispatch.MaskArgs,
                     forward_key: tuple | None = None) -> torch.Tensor:
    """-> dqkv (B, T, 3, H, D), contiguous: (B, T, 3C) as the qkv projection's backward takes it."""
    dqkv = qkv.new_empty(qkv.shape)
    dispatch.backward(do, *unpack_qkv(qkv), o, lse, causal, scale, mask, grads=unpack_qkv(dqkv),
                      forward_key=forward_key)
    return dqkv


class FlashAttentionFunction(torch.autograd.Function):
    """Eager autograd for the kernels (torch.compile takes the operators, module docstring). varlen: a
    dispatch.Varlen for q (total_q, Hq, D), k and v (total_k, Hkv, D) (§14). ctx.plan_key: the forward's plan key,
    which with dO's layout keys the backward's plan (dispatch.forward_key)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, mask: dispatch.MaskArgs, varlen=None):
        ctx.plan_key = dispatch.forward_key(causal, mask, varlen, q, k, v)
        o, lse = dispatch.forward(q, k, v, causal, scale, mask, varlen, ctx.plan_key)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.mask, ctx.varlen = causal, scale, mask, varlen
        ctx.mark_non_differentiable(lse)  # the log-sum-exp is returned for inspection, not for training
        ctx.set_materialize_grads(False)  # lse never gets a gradient: don't allocate zeros for it
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = dispatch.backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.mask, varlen=ctx.varlen,
                                       forward_key=ctx.plan_key)
        return dq, dk, dv, None, None, None, None


class PackedFlashAttentionFunction(torch.autograd.Function):
    """FlashAttentionFunction for q, k, v packed in one (B, T, 3, H, D) tensor. Given three views, autograd
    would concatenate their three gradients into the gradient of the tensor they view (a copy of its
    size per call, docs/perf_notes.md, "Packed qkv"); this backward writes them into one (B, T, 3, H, D)
    gradient directly."""

    @staticmethod
    def forward(ctx, qkv, causal: bool, scale: float, mask: dispatch.MaskArgs):
        q, k, v = unpack_qkv(qkv)
        ctx.plan_key = dispatch.forward_key(causal, mask, None, q, k, v)
        o, lse = dispatch.forward(q, k, v, causal, scale, mask, None, ctx.plan_key)
        ctx.save_for_backward(qkv, o, lse)
        ctx.causal, ctx.scale, ctx.mask = causal, scale, mask
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        qkv, o, lse = ctx.saved_tensors
        return _packed_backward(do, qkv, o, lse, ctx.causal, ctx.scale, ctx.mask, ctx.plan_key), None, None, None


def kernel_mask_args(mask) -> dispatch.MaskArgs:
    """A BlockMask as the kernels' arguments (the block lists, and on Hopper the documents' spans, are built once per
    BlockMask and cached)."""
    if mask is None:
        return dispatch.DENSE
    docs = mask.document_ids
    # §14 documents alone (causal or not) the Hopper kernels keep to themselves, from each position's span
    spans = mask.document_spans() if mask.only_documents() and is_hopper(docs.device) else None
    return dispatch.MaskArgs(mask.kv_blocks(), mask.q_blocks(), mask.window,
                             docs if docs is None else docs.contiguous(), mask.tile_bits, mask.block_size, spans)


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


def triton_attention(q, k, v, causal: bool, scale: float, return_lse: bool = False, mask=None, qkv=None):
    """flash_attention for inputs that already passed check_qkv (the registry checks them once).
    mask: an attention.BlockMask holding every rule of the call (then `causal` is its causal rule).
    qkv: the (B, T, 3, H, D) tensor that q, k, v are the unpack_qkv views of, if they are (then its
    gradient comes out of the backward as one tensor)."""
    check_triton_support(q)
    mask = kernel_mask_args(mask)
    if torch.compiler.is_compiling():  # the operators (module docstring)
        if qkv is not None:
            out, lse = flash_attn_fwd_qkvpacked(qkv, causal, scale, *_op_args(mask))
        else:
            out, lse = flash_attn_fwd(q, k, v, causal, scale, *_op_args(mask))
    elif qkv is not None:
        out, lse = PackedFlashAttentionFunction.apply(qkv, causal, scale, mask)
    else:
        out, lse = FlashAttentionFunction.apply(q, k, v, causal, scale, mask)
    return (out, lse) if return_lse else out


def triton_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                            scale: float, window: tuple[int, int] | None = None) -> torch.Tensor:
    """attention_varlen's triton backend (§14), on inputs attention/varlen.py has checked: q (total_q, Hq, D), k, v
    (total_k, Hkv, D), cu_seqlens int32 on their device. -> (total_q, Hq, D)."""
    check_triton_support(q)
    varlen = dispatch.Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # §14 self-attention over packed sequences (one cu_seqlens for both) is documents in one batch entry: on Hopper
    # the warp-specialized kernels may run it, from each row's span
    spans = None
    if (window is None and cu_seqlens_q is cu_seqlens_k and q.shape[0] == k.shape[0]
            and max_seqlen_q == max_seqlen_k and is_hopper(q.device)):
        spans = sequence_spans(cu_seqlens_q, q.shape[0])
    mask = dispatch.MaskArgs(window=window, spans=spans)
    if torch.compiler.is_compiling():  # the operators (module docstring)
        return flash_attn_fwd(q, k, v, causal, scale, *_op_args(mask, varlen))[0]
    return FlashAttentionFunction.apply(q, k, v, causal, scale, mask, varlen)[0]
