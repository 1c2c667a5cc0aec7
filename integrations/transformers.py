"""nanoflash attention inside Hugging Face transformers models (tested with Llama and GPT-2).

    import torch
    from transformers import AutoModelForCausalLM
    from integrations.transformers import register

    name = register("triton")   # -> "nanoattn_triton"; any backend of attention.available_backends()
    model = AutoModelForCausalLM.from_pretrained(
        "meta-llama/Llama-3.2-1B", attn_implementation=name, dtype=torch.bfloat16
    ).cuda()
    # or switch a loaded model: model.set_attn_implementation(name)

Grouped-query k/v go to the kernel as they are (no repeat). Supported: causal attention on
batches without padding, with or without a (dynamic) KV cache, so generate() works too. Padded
batches, packed sequences, a sliding window the sequence has outgrown, a static cache, attention
dropout in training, softcapping and attention sinks raise a ValueError: use
attn_implementation="sdpa" for those.
"""
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from attention import attention, causal_mask, get_backend

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
            "reads as a request for its own attention code; pick another name, e.g. the default"
        )
    AttentionInterface.register(name, _attention_forward_for(backend))
    # The mask builder decides what reaches the attention function. sdpa's returns None for a plain
    # causal (or full) batch, so the common case costs nothing, and a 4-D bool mask otherwise. Without
    # a builder registered under our name, transformers would drop padding masks without a word.
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


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
        # as in transformers' sdpa: a per-call is_causal overrides the module's
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        Tq, Tk = query.shape[2], key.shape[2]
        if attention_mask is None and causal and 1 < Tq < Tk:
            # transformers only skips the mask here when the keys past Tq are unwritten static-cache
            # slots (top-left alignment); our causal is bottom-right and would attend to them
            raise ValueError(
                "nanoflash attention got no mask for a query block shorter than the keys (a static KV "
                'cache prefill); use the default dynamic cache or attn_implementation="sdpa"'
            )
        if attention_mask is not None and not _is_causal_mask(attention_mask, Tq, Tk):
            raise ValueError(
                "nanoflash attention supports only the plain causal mask, but got another attention_mask "
                "(padding, packed sequences or a sliding window); batch sequences of one length without "
                'padding, or use attn_implementation="sdpa"'
            )
        # a mask that passed the check is the causal mask, whatever the module says
        causal = causal or attention_mask is not None
        y = attention(query, key, value, causal=causal, scale=scaling, backend=backend)  # (B, nh, Tq, hs)
        # (B, nh, Tq, hs) -> (B, Tq, nh, hs); contiguous() is free for the Triton backend, whose
        # output already lies in (B, T, nh, hs) order, and models may .view() the result
        return y.transpose(1, 2).contiguous(), None

    return attention_forward


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
