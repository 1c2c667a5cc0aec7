"""nanoflash attention inside Hugging Face transformers models (tested with Llama and GPT-2).

    import torch
    from transformers import AutoModelForCausalLM
    from nanoflash.integrations.transformers import register   # from a checkout: attention.integrations...

    name = register("triton")   # -> "nanoattn_triton"; any backend of available_backends()
    model = AutoModelForCausalLM.from_pretrained(
        "meta-llama/Llama-3.2-1B", attn_implementation=name, dtype=torch.bfloat16
    ).cuda()
    # or switch a loaded model: model.set_attn_implementation(name)

Grouped-query k/v go to the kernel as they are (no repeat). Supported: causal attention with or
without a (dynamic) KV cache, so generate() works too, on batches with or without padding (left or
right: an attention_mask with zeros). A batch without padding runs attention() as it is; a padded one
is unpadded into attention_varlen, as transformers' FlashAttention-2 path does: each row's tokens
packed end to end, the outputs at padded queries 0. Packed sequences (position_ids that restart), a
custom 4-D mask other than the causal one, a sliding window on a padded batch or one the sequence
has outgrown, a static cache, attention dropout in training, softcapping and attention sinks raise a
ValueError: use attn_implementation="sdpa" for those.
"""
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import causal_mask_function, sdpa_mask

from .. import attention, attention_varlen, causal_mask, get_backend

# transformers chooses code paths from substrings of the implementation's name: a name containing
# "flash" makes it import the flash-attn package, "sdpa" or "flex_attention" runs those backends'
# checks, "paged" is stripped, and "org/repo" is fetched as a kernel from the Hub.
_RESERVED_IN_NAMES = ("flash", "sdpa", "flex_attention", "paged", "/")
# keyword arguments some models pass that change the math; our kernels have no term for them
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")


def register(backend: str = "triton", name: str | None = None) -> str:
    """Register nanoflash's `backend` with transformers as attn_implementation `name`
    (default "nanoattn_<backend>") and return the name. Registering again is harmless."""
    get_backend(backend)  # unknown backend: ValueError listing the available ones
    name = f"nanoattn_{backend}" if name is None else name
    if any(part in name for part in _RESERVED_IN_NAMES):
        raise ValueError(
            f"attn_implementation name {name!r} contains one of {_RESERVED_IN_NAMES}, which transformers "
            "reads as a request for its own attention code; pass another, e.g. "
            f'register({backend!r}, name="nanoattn_ref")'
        )
    AttentionInterface.register(name, _attention_forward_for(backend))
    # The mask builder decides what reaches the attention function. Without a builder registered under
    # our name, transformers would drop padding masks without a word.
    AttentionMaskInterface.register(name, _padding_or_sdpa_mask)
    return name


def _padding_or_sdpa_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                          mask_function=causal_mask_function, attention_mask=None, allow_is_causal_skip=True,
                          **kwargs):
    """transformers' mask builder for our implementations. A padded batch under the plain causal mask whose
    queries are the last q_length of its keys (no cache, or a dynamic one) gets its 2-D padding mask
    (B, kv_length), True at tokens, which the attention function unpads, as FlashAttention-2's builder does.
    Everything else gets sdpa's mask: None for a causal batch without padding, so it costs nothing, and a 4-D
    bool mask otherwise, which the attention function takes only if it is the causal mask. A caller that asks
    for a materialized mask (allow_is_causal_skip=False) gets sdpa's too."""
    if (mask_function is causal_mask_function and allow_is_causal_skip and attention_mask is not None
            and kv_offset == 0 and attention_mask.shape[-1] == kv_length == q_offset + q_length):
        if not attention_mask.all():
            return attention_mask
        attention_mask = None  # no padding: the same as no mask, and sdpa_mask need not read it again
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def _attention_forward_for(backend: str):
    def attention_forward(
        module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None, **kwargs
    ):
        """transformers' attention interface: query (B, nh, Tq, hs), key/value (B, nh_kv, Tk, hs);
        returns ((B, Tq, nh, hs), None): flash kernels never form the attention weights."""
        if dropout > 0:
            raise ValueError(
                f"attention dropout {dropout} is not supported by nanoflash attention (flash kernels never "
                "form the probabilities); set the config's attention dropout to 0 (attention_dropout / "
                'attn_pdrop) or use attn_implementation="sdpa"'
            )
        for kwarg in _UNSUPPORTED_KWARGS:
            if kwargs.get(kwarg) is not None:
                raise ValueError(
                    f"{type(module).__name__} passes {kwarg}, which nanoflash attention does not support; "
                    'use attn_implementation="sdpa" or "eager"'
                )
        B, Tq, Tk = query.shape[0], query.shape[2], key.shape[2]
        if attention_mask is not None and tuple(attention_mask.shape) == (B, Tk):
            # our mask builder's padding mask: it comes only for a padded batch under the causal mask
            return _padded_attention(query, key, value, attention_mask, scaling, backend), None
        # as in transformers' sdpa: a per-call is_causal overrides the module's
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if attention_mask is None and causal and 1 < Tq < Tk:
            # transformers only skips the mask here when the keys past Tq are unwritten static-cache
            # slots (top-left alignment); our causal is bottom-right and would attend to them
            raise ValueError(
                "nanoflash attention got no mask for a query block shorter than the keys (a static KV "
                'cache prefill); use the default dynamic cache or attn_implementation="sdpa"'
            )
        if attention_mask is not None and not _is_causal_mask(attention_mask, Tq, Tk):
            raise ValueError(
                "nanoflash attention supports the causal mask with or without padding, but got another "
                "attention_mask (packed sequences, a sliding window or a custom 4-D mask); "
                'use attn_implementation="sdpa"'
            )
        # a mask that passed the check is the causal mask, whatever the module says
        causal = causal or attention_mask is not None
        y = attention(query, key, value, causal=causal, scale=scaling, backend=backend)  # (B, nh, Tq, hs)
        # (B, nh, Tq, hs) -> (B, Tq, nh, hs); contiguous() is free for the Triton backend, whose
        # output already lies in (B, T, nh, hs) order, and models may .view() the result
        return y.transpose(1, 2).contiguous(), None

    return attention_forward


def _padded_attention(query, key, value, padding_mask, scale, backend: str) -> torch.Tensor:
    """Causal attention on a padded batch: the tokens of every row packed end to end into attention_varlen,
    the output scattered back. query (B, nh, Tq, hs), key/value (B, nh_kv, Tk, hs), padding_mask (B, Tk),
    True at tokens. The queries are the last Tq positions of the keys (a KV cache continues the sequences), so
    their mask is the last Tq columns; within a row, varlen's bottom-right causal alignment then lets each query
    see the tokens up to its own position. -> (B, Tq, nh, hs), 0 at padded queries."""
    B, nh, Tq, hs = query.shape
    rows_k, cu_seqlens_k, max_seqlen_k = _packed_rows(padding_mask)
    rows_q, cu_seqlens_q, max_seqlen_q = (
        (rows_k, cu_seqlens_k, max_seqlen_k) if Tq == key.shape[2] else _packed_rows(padding_mask[:, -Tq:])
    )
    # (B, nh, T, hs) -> (B, T, nh, hs) -> the (total, nh, hs) rows of the tokens
    q, k, v = (t.transpose(1, 2)[rows] for t, rows in ((query, rows_q), (key, rows_k), (value, rows_k)))
    y = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale,
                         causal=True, backend=backend)
    return y.new_zeros(B, Tq, nh, hs).index_put(rows_q, y)


def _packed_rows(padding_mask):
    """(B, T) padding mask -> the (batch, position) indices of its tokens, row after row, the cu_seqlens of
    the rows (B + 1,) int32 and the longest row's token count."""
    lengths = padding_mask.sum(-1, dtype=torch.int32)
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return padding_mask.nonzero(as_tuple=True), cu_seqlens, int(lengths.max())


def _is_causal_mask(mask, Tq: int, Tk: int) -> bool:
    """True if `mask` (bool: True = attend, or additive float: 0 / -inf or the dtype's lowest value)
    of shape (B or 1, nh or 1, Tq, Tk) is our bottom-right causal mask for every batch and head.
    transformers builds one when a block of queries continues a KV cache. One pass over the mask and
    one host sync per layer: small next to the attention itself."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[-2:]) != (Tq, Tk):
        return False
    if not (mask.dtype == torch.bool or mask.is_floating_point()):
        return False
    if mask.dtype == torch.bool:
        attends, blocks = mask, ~mask
    else:
        attends = mask == 0
        blocks = torch.isneginf(mask) | (mask == torch.finfo(mask.dtype).min)
    visible = causal_mask(Tq, Tk, device=mask.device)  # (Tq, Tk)
    return bool(torch.where(visible, attends, blocks).all())
