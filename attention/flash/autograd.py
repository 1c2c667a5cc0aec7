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

FlashAttention's terms (§15: softcap, ALiBi slopes, sinks; §16 dropout_p and its seed) are the ops' last arguments
(Terms); the backward ops return the sinks' gradient too (an empty tensor without sinks). The dropout seed is
a tensor argument, drawn by a random op before the forward op (dropout.draw_seed): a compiled graph draws it anew on
every run, and the forward op's autograd context keeps it for the backward op.

q, k, v packed in one (B, T, 3, H, D) tensor (a fused qkv projection's output, attention_qkvpacked)
take PackedFlashAttentionFunction (nanoflash::flash_attn_fwd_qkvpacked compiled), whose backward
(nanoflash::flash_attn_bwd_qkvpacked) writes the three gradients into one tensor of that shape.
"""
import torch

from . import dispatch, native
from ..inputs import check_qkv, check_terms, sequence_spans, unpack_qkv
from .launch import recording
from .ops import define_op
from .terms import NO_TERMS, Terms, plain_call, terms_of
from .device import check_triton_support, is_hopper
from .dropout import draw_seed

# The arguments every op takes after (causal, scale): MaskArgs, Varlen and Terms flattened into operator types
MASK_SCHEMA = ("Tensor? kv_blocks=None, Tensor? q_blocks=None, Tensor? document_ids=None, Tensor? tile_bits=None, "
               "int window_left=-1, int window_right=-1, int block_size=16, Tensor? spans=None, "
               "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, int max_seqlen_q=0, int max_seqlen_k=0, "
               "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None, float dropout_p=0.0, "
               "Tensor? dropout_seed=None")


def _from_op_args(kv_blocks=None, q_blocks=None, document_ids=None, tile_bits=None, window_left: int = -1,
                  window_right: int = -1, block_size: int = 16, spans=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  max_seqlen_q: int = 0, max_seqlen_k: int = 0, softcap: float = 0.0, alibi_slopes=None, sinks=None,
                  dropout_p: float = 0.0, dropout_seed=None):
    """-> (MaskArgs, Varlen or None, Terms) from the ops' flat arguments."""
    window = None if (window_left, window_right) == (-1, -1) else (window_left, window_right)
    varlen = None if cu_seqlens_q is None else dispatch.Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return (dispatch.MaskArgs(kv_blocks, q_blocks, window, document_ids, tile_bits, block_size, spans), varlen,
            terms_of(softcap, alibi_slopes, sinks, dropout_p, dropout_seed))


def _op_args(mask: dispatch.MaskArgs, varlen: dispatch.Varlen | None = None,
             terms: Terms = NO_TERMS) -> tuple:
    left, right = mask.window or (-1, -1)
    return (mask.kv_blocks, mask.q_blocks, mask.document_ids, mask.tile_bits, left, right, mask.block_size,
            mask.spans, *(varlen or (None, None, 0, 0)), *terms)


def _flash_attn_fwd(q, k, v, causal, scale, *mask):
    mask, varlen, terms = _from_op_args(*mask)
    return dispatch.forward(q, k, v, causal, scale, mask, varlen, terms=terms)


def _flash_attn_fwd_fake(q, k, v, causal, scale, *mask):
    # the same allocation as the real op, so compiled graphs see the real (B, T, H, Dv) strides
    Dv = v.shape[-1]
    if _from_op_args(*mask)[1] is not None:  # varlen: (total_q, Hq, Dv) and (Hq, total_q)
        return q.new_empty(*q.shape[:2], Dv), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    B, Hq, Tq, _ = q.shape
    return dispatch.empty_bthd(B, Hq, Tq, Dv, q), q.new_empty(B, Hq, Tq, dtype=torch.float32)


def _sink_grad_out(grads: tuple, q, sinks):
    """The ops' fourth output: the sinks' gradient (dispatch.backward's, shaped like them), else an empty tensor."""
    return grads[3] if sinks is not None else q.new_empty(0)


def _flash_attn_bwd(do, q, k, v, o, lse, causal, scale, *mask):
    mask, varlen, terms = _from_op_args(*mask)
    grads = dispatch.backward(do, q, k, v, o, lse, causal, scale, mask, varlen=varlen, terms=terms)
    return *grads[:3], _sink_grad_out(grads, q, terms.sinks)


def _flash_attn_bwd_fake(do, q, k, v, o, lse, causal, scale, *mask):
    _, varlen, terms = _from_op_args(*mask)
    dsinks = q.new_empty(0) if terms.sinks is None else terms.sinks.new_empty(terms.sinks.shape)
    if varlen is not None:
        return *(t.new_empty(t.shape) for t in (q, k, v)), dsinks
    return *(dispatch.empty_bthd(*t.shape, t) for t in (q, k, v)), dsinks


flash_attn_bwd = define_op(
    f"flash_attn_bwd(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool causal, float scale, "
    f"{MASK_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)",
    _flash_attn_bwd, _flash_attn_bwd_fake)


def _flash_attn_bwd_qkvpacked(do, qkv, o, lse, causal, scale, *mask):
    mask, _, terms = _from_op_args(*mask)
    dqkv, dsinks = _packed_backward(do, qkv, o, lse, causal, scale, mask, terms=terms)
    return dqkv, qkv.new_empty(0) if dsinks is None else dsinks


def _flash_attn_bwd_qkvpacked_fake(do, qkv, o, lse, causal, scale, *mask):
    sinks = _from_op_args(*mask)[2].sinks
    return qkv.new_empty(qkv.shape), qkv.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)


flash_attn_bwd_qkvpacked = define_op(
    f"flash_attn_bwd_qkvpacked(Tensor do, Tensor qkv, Tensor o, Tensor lse, bool causal, float scale, "
    f"{MASK_SCHEMA}) -> (Tensor, Tensor)",
    _flash_attn_bwd_qkvpacked, _flash_attn_bwd_qkvpacked_fake)


def _flash_attn_fwd_qkvpacked(qkv, causal, scale, *mask):
    return _flash_attn_fwd(*unpack_qkv(qkv), causal, scale, *mask)


def _flash_attn_fwd_qkvpacked_fake(qkv, causal, scale, *mask):
    return _flash_attn_fwd_fake(*unpack_qkv(qkv), causal, scale, *mask)


# The places of the tensors among the ops' mask arguments, read off MASK_SCHEMA, and of the sinks, the one that takes
# a gradient
_MASK_ARGS = MASK_SCHEMA.split(", ")
MASK_TENSORS = tuple(i for i, arg in enumerate(_MASK_ARGS) if arg.startswith("Tensor"))
SINKS = _MASK_ARGS.index("Tensor? sinks=None")


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


def _mask_grads(mask: list, dsinks) -> list:
    """The gradients of the ops' mask arguments: none but the sinks' (§15), where there are sinks."""
    grads = [None] * len(mask)
    if mask[SINKS] is not None:
        grads[SINKS] = dsinks
    return grads


def _fwd_setup(ctx, inputs, output):
    q, k, v, causal, scale, *mask = inputs
    _keep(ctx, (q, k, v, *output), causal, scale, mask)


def _fwd_backward(ctx, do, _dlse):
    (q, k, v, o, lse), mask = _kept(ctx, 5)
    dq, dk, dv, dsinks = flash_attn_bwd(do, q, k, v, o, lse, ctx.causal, ctx.scale, *mask)
    return dq, dk, dv, None, None, *_mask_grads(mask, dsinks)


def _fwd_qkvpacked_setup(ctx, inputs, output):
    qkv, causal, scale, *mask = inputs
    _keep(ctx, (qkv, *output), causal, scale, mask)


def _fwd_qkvpacked_backward(ctx, do, _dlse):
    (qkv, o, lse), mask = _kept(ctx, 3)
    dqkv, dsinks = flash_attn_bwd_qkvpacked(do, qkv, o, lse, ctx.causal, ctx.scale, *mask)
    return dqkv, None, None, *_mask_grads(mask, dsinks)


# torch.compile's way in (module docstring): the forward ops carry their autograd
flash_attn_fwd = define_op(
    f"flash_attn_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale, {MASK_SCHEMA}) -> (Tensor, Tensor)",
    _flash_attn_fwd, _flash_attn_fwd_fake, _fwd_backward, _fwd_setup)
flash_attn_fwd_qkvpacked = define_op(
    f"flash_attn_fwd_qkvpacked(Tensor qkv, bool causal, float scale, {MASK_SCHEMA}) -> (Tensor, Tensor)",
    _flash_attn_fwd_qkvpacked, _flash_attn_fwd_qkvpacked_fake, _fwd_qkvpacked_backward, _fwd_qkvpacked_setup)


def _packed_backward(do, qkv, o, lse, causal: bool, scale: float, mask: dispatch.MaskArgs,
                     forward_key: tuple | None = None, terms: Terms = NO_TERMS):
    """-> dqkv (B, T, 3, H, D), contiguous: (B, T, 3C) as the qkv projection's backward takes it; and the sinks'
    gradient, None without sinks."""
    dqkv = qkv.new_empty(qkv.shape)
    grads = dispatch.backward(do, *unpack_qkv(qkv), o, lse, causal, scale, mask, grads=unpack_qkv(dqkv),
                              forward_key=forward_key, terms=terms)
    return dqkv, grads[3] if terms.sinks is not None else None


# native.py's plans by id -> (causal, scale, the forward's plan key): what a backward without a kept pass needs
_native_calls: dict[int, tuple] = {}


def _native_eligible(q, mask: dispatch.MaskArgs, varlen, terms: Terms, v) -> bool:
    """Whether the native extension may keep this call's plan (§9 "Launches without Python"): a dense CUDA call
    without terms, the native path on."""
    return (mask is dispatch.DENSE and varlen is None and q.is_cuda and plain_call(terms, q, v)
            and not native.python_path_only())


def _keep_forward(given: tuple, inside: tuple, outputs: tuple, record, causal: bool, scale: float,
                  plan_key) -> int | None:
    """Keep a plan's recorded forward in the native extension: -> its id there, or None (not a plan's run, a launch
    C++ cannot make, or the extension not built yet: a plan's run, a call repeated, starts its build)."""
    module = native.load() if record.planned else None
    forward_pass = None if module is None else native.make_pass(record.launches, given, inside, outputs)
    if forward_pass is None:
        return None
    plan = module.add_plan(list(given), causal, scale, forward_pass)
    _native_calls[plan] = (causal, scale, plan_key)
    return plan


def _keep_backward(plan: int, given: tuple, inside: tuple, outputs: tuple, record) -> None:
    """Keep a plan's recorded backward for dO's layout (given[0]) beside its forward."""
    module = native.loaded()
    backward_pass = None if module is None or not record.planned else native.make_pass(record.launches, given,
                                                                                         inside, outputs)
    if backward_pass is not None:
        module.add_backward(plan, given[0], backward_pass)


def native_backward_miss(plan: int, do, *saved) -> list:
    """native_launch.cpp's backward of a plan without a pass for this dO's layout: the Python path, recorded and kept
    for the next one. saved: the forward's (q, k, v, o, lse), or (qkv, o, lse) for a packed call."""
    causal, scale, plan_key = _native_calls[plan]
    packed = len(saved) == 3
    with recording() as record:
        if packed:
            grads = _packed_backward(do, *saved, causal, scale, dispatch.DENSE, plan_key)[:1]  # dqkv
        else:
            grads = dispatch.backward(do, *saved, causal, scale, forward_key=plan_key)
    inside = (False, True, False, False) if packed else (False,) * 6
    _keep_backward(plan, (do, *saved), inside, grads, record)
    return list(grads)


native.set_backward_miss(native_backward_miss)


class FlashAttentionFunction(torch.autograd.Function):
    """Eager autograd for the kernels (torch.compile takes the operators, module docstring). varlen: a
    dispatch.Varlen for q (total_q, Hq, D), k and v (total_k, Hkv, D) (§14). softcap, alibi_slopes, sinks: §15's
    terms (Terms); the sinks get a gradient. ctx.plan_key: the forward's plan key, which with dO's layout
    keys the backward's plan (dispatch.forward_key). ctx.native: the plan's id in the native extension, where a run of
    the plan was kept there (§9 "Launches without Python"; later calls of the key go there instead)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, mask: dispatch.MaskArgs, varlen=None, softcap: float = 0.0,
                alibi_slopes=None, sinks=None, dropout_p: float = 0.0, dropout_seed=None):
        terms = terms_of(softcap, alibi_slopes, sinks, dropout_p, dropout_seed)
        ctx.plan_key = dispatch.forward_key(causal, mask, varlen, q, k, v, terms)
        eligible = _native_eligible(q, mask, varlen, terms, v)
        with recording(on=eligible) as record:
            o, lse = dispatch.forward(q, k, v, causal, scale, mask, varlen, ctx.plan_key, terms)
        ctx.native = _keep_forward((q, k, v), (False,) * 3, (o, lse), record, causal, scale,
                                   ctx.plan_key) if eligible else None
        ctx.save_for_backward(q, k, v, o, lse, alibi_slopes, sinks, dropout_seed)
        ctx.causal, ctx.scale, ctx.mask, ctx.varlen, ctx.softcap = causal, scale, mask, varlen, softcap
        ctx.dropout_p = dropout_p
        ctx.mark_non_differentiable(lse)  # the log-sum-exp is returned for inspection, not for training
        ctx.set_materialize_grads(False)  # lse never gets a gradient: don't allocate zeros for it
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, alibi_slopes, sinks, seed = ctx.saved_tensors
        terms = terms_of(ctx.softcap, alibi_slopes, sinks, ctx.dropout_p, seed)
        with recording(on=ctx.native is not None) as record:
            grads = dispatch.backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.mask, varlen=ctx.varlen,
                                      forward_key=ctx.plan_key, terms=terms)
        if ctx.native is not None:
            _keep_backward(ctx.native, (do, q, k, v, o, lse), (False,) * 6, grads[:3], record)
        return *grads[:3], None, None, None, None, None, None, grads[3] if sinks is not None else None, None, None


class PackedFlashAttentionFunction(torch.autograd.Function):
    """FlashAttentionFunction for q, k, v packed in one (B, T, 3, H, D) tensor. Given three views, autograd
    would concatenate their three gradients into the gradient of the tensor they view (a copy of its
    size per call, docs/perf_notes.md, "Packed qkv"); this backward writes them into one (B, T, 3, H, D)
    gradient directly."""

    @staticmethod
    def forward(ctx, qkv, causal: bool, scale: float, mask: dispatch.MaskArgs, softcap: float = 0.0,
                alibi_slopes=None, sinks=None, dropout_p: float = 0.0, dropout_seed=None):
        q, k, v = unpack_qkv(qkv)
        terms = terms_of(softcap, alibi_slopes, sinks, dropout_p, dropout_seed)
        ctx.plan_key = dispatch.forward_key(causal, mask, None, q, k, v, terms)
        eligible = _native_eligible(q, mask, None, terms, v)
        with recording(on=eligible) as record:
            o, lse = dispatch.forward(q, k, v, causal, scale, mask, None, ctx.plan_key, terms)
        ctx.native = _keep_forward((qkv,), (True,), (o, lse), record, causal, scale,
                                   ctx.plan_key) if eligible else None
        ctx.save_for_backward(qkv, o, lse, alibi_slopes, sinks, dropout_seed)
        ctx.causal, ctx.scale, ctx.mask, ctx.softcap, ctx.dropout_p = causal, scale, mask, softcap, dropout_p
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        qkv, o, lse, alibi_slopes, sinks, seed = ctx.saved_tensors
        with recording(on=ctx.native is not None) as record:
            dqkv, dsinks = _packed_backward(do, qkv, o, lse, ctx.causal, ctx.scale, ctx.mask, ctx.plan_key,
                                            terms_of(ctx.softcap, alibi_slopes, sinks, ctx.dropout_p, seed))
        if ctx.native is not None:
            _keep_backward(ctx.native, (do, qkv, o, lse), (False, True, False, False), (dqkv,), record)
        return dqkv, None, None, None, None, None, dsinks, None, None


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
    *,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
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
    softcap, alibi_slopes, sinks: FlashAttention's terms (§15, attention()'s); v may have a head dim of its own.
    dropout_p: attention dropout (§16, attention()'s).
    """
    check_qkv(q, k, v, scale, value_head_dim=True)
    check_terms(q, q.shape[0], q.shape[1], softcap, alibi_slopes, sinks, dropout_p=dropout_p)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return triton_attention(q, k, v, causal, float(scale), return_lse, softcap=float(softcap),
                            alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=float(dropout_p))


def triton_attention(q, k, v, causal: bool, scale: float, return_lse: bool = False, mask=None, qkv=None,
                     softcap: float = 0.0, alibi_slopes=None, sinks=None, dropout_p: float = 0.0):
    """flash_attention for inputs that already passed check_qkv (the registry checks them once).
    mask: an attention.BlockMask holding every rule of the call (then `causal` is its causal rule).
    qkv: the (B, T, 3, H, D) tensor that q, k, v are the unpack_qkv views of, if they are (then its
    gradient comes out of the backward as one tensor). softcap, alibi_slopes, sinks: §15's, checked; dropout_p §16's,
    checked, for which the call draws a seed of its own."""
    check_triton_support(q)
    if v.shape[-1] != q.shape[-1]:
        check_triton_support(v)  # its head dim too
    mask = kernel_mask_args(mask)
    seed = draw_seed(q.device) if dropout_p else None
    terms = terms_of(softcap, alibi_slopes, sinks, dropout_p, seed)
    if torch.compiler.is_compiling():  # the operators (module docstring)
        if qkv is not None:
            out, lse = flash_attn_fwd_qkvpacked(qkv, causal, scale, *_op_args(mask, None, terms))
        else:
            out, lse = flash_attn_fwd(q, k, v, causal, scale, *_op_args(mask, None, terms))
        return (out, lse) if return_lse else out
    # §9 "Launches without Python": a call of a key whose plan the extension keeps runs there; None: not kept yet
    module = native.loaded() if _native_eligible(q, mask, None, terms, v) else None
    found = None if module is None else (module.forward_packed(qkv, causal, scale) if qkv is not None
                                         else module.forward(q, k, v, causal, scale))
    if found is not None:
        out, lse = found
    elif qkv is not None:
        out, lse = PackedFlashAttentionFunction.apply(qkv, causal, scale, mask, *terms)
    else:
        out, lse = FlashAttentionFunction.apply(q, k, v, causal, scale, mask, None, *terms)
    return (out, lse) if return_lse else out


def triton_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                            scale: float, window: tuple[int, int] | None = None, softcap: float = 0.0,
                            alibi_slopes=None, sinks=None, return_lse: bool = False, dropout_p: float = 0.0):
    """attention_varlen's triton backend (§14), on inputs attention/varlen.py has checked: q (total_q, Hq, D), k, v
    (total_k, Hkv, Dv), cu_seqlens int32 on their device. -> (total_q, Hq, Dv); with return_lse also lse (Hq, total_q).
    softcap, alibi_slopes ((Hq,) or (n, Hq)), sinks: §15's; dropout_p §16's (a seed drawn per call)."""
    check_triton_support(q)
    if v.shape[-1] != q.shape[-1]:
        check_triton_support(v)
    varlen = dispatch.Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    terms = terms_of(softcap, alibi_slopes, sinks, dropout_p, draw_seed(q.device) if dropout_p else None)
    # §14 self-attention over packed sequences (one cu_seqlens for both) is documents in one batch entry: on Hopper
    # the warp-specialized kernels may run it, from each row's span (not with §15's terms, which they lack)
    spans = None
    if (window is None and cu_seqlens_q is cu_seqlens_k and q.shape[0] == k.shape[0]
            and max_seqlen_q == max_seqlen_k and is_hopper(q.device) and plain_call(terms, q, v)):
        spans = sequence_spans(cu_seqlens_q, q.shape[0])
    mask = dispatch.MaskArgs(window=window, spans=spans)
    if torch.compiler.is_compiling():  # the operators (module docstring)
        out, lse = flash_attn_fwd(q, k, v, causal, scale, *_op_args(mask, varlen, terms))
    else:
        out, lse = FlashAttentionFunction.apply(q, k, v, causal, scale, mask, varlen, *terms)
    return (out, lse) if return_lse else out
