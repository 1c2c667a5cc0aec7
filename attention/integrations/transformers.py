"""nanoflash attention inside Hugging Face transformers models (tested with Llama, GPT-2, Gemma 2, gpt-oss and
DeepSeek-V3).

    import torch
    from transformers import AutoModelForCausalLM
    from nanoflash.integrations.transformers import register   # from a checkout: attention.integrations...

    name = register("triton")   # -> "nanoattn_triton"; any backend of available_backends()
    model = AutoModelForCausalLM.from_pretrained(
        "meta-llama/Llama-3.2-1B", attn_implementation=name, dtype=torch.bfloat16
    ).cuda()
    # or switch a loaded model: model.set_attn_implementation(name)

What a model passes maps onto attention() / attention_varlen(): its scaling; grouped-query k/v as they are (no
repeat); a value head dim of its own (MLA: DeepSeek-V3, Kimi); softcap (Gemma 2's attn_logit_softcapping); s_aux
(gpt-oss's learned sink logit per head) as sinks, with its gradient; sliding_window=w, under which transformers' mask
lets query i see keys i - w < j <= i, as window=(w - 1, 0). Causal attention with or without a (dynamic) KV cache, so
generate() works too. A padded batch (an attention_mask with zeros) is unpadded into attention_varlen, as
transformers' FlashAttention-2 path does: each row's tokens packed end to end, the outputs at padded queries 0.
Packed sequences in a row run through attention_varlen, one sequence each: told by a mask transformers builds from
position_ids that restart (use_cache=False), by such position_ids without a mask (as FlashAttention-2 reads them), or
by cu_seq_lens_q/k (DataCollatorWithFlattening(return_flash_attn_kwargs=True)). A 4-D mask is read once per forward
pass and taken only if it is one of these (causal, within the window, within a row's sequences, padded keys left
out). Attention dropout in training (GPT-2's attn_pdrop) goes to the kernels' dropout_p. Everything else raises a
one-line ValueError: a custom 4-D mask, a static cache, other bias terms (position_bias).
"""
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import causal_mask_function, sdpa_mask

from .. import attention, attention_varlen, causal_mask, get_backend
from ..inputs import kept_per_tensor
from ..masks import window_mask

# transformers chooses code paths from substrings of the implementation's name: a name containing
# "flash" makes it import the flash-attn package, "sdpa" or "flex_attention" runs those backends'
# checks, "paged" is stripped, and "org/repo" is fetched as a kernel from the Hub.
_RESERVED_IN_NAMES = ("flash", "sdpa", "flex_attention", "paged", "/")
# keyword arguments some models pass that change the math; our kernels have no term for them
_UNSUPPORTED_KWARGS = ("sinks", "position_bias")


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
    Everything else gets sdpa's mask: None for a causal batch without padding (or a window longer than the
    keys), so it costs nothing, and a 4-D bool mask otherwise (a sliding window, packed sequences, padding with a
    window), which the attention function reads once per forward pass and takes only if it is one of the masks
    it computes: (B, T, T) booleans, as sdpa and eager get. A caller that asks for a materialized mask
    (allow_is_causal_skip=False) gets sdpa's too."""
    if (mask_function is causal_mask_function and allow_is_causal_skip and attention_mask is not None
            and kv_offset == 0 and attention_mask.shape[-1] == kv_length == q_offset + q_length):
        if not attention_mask.all():
            return attention_mask
        attention_mask = None  # no padding: the same as no mask, and sdpa_mask need not read it again
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def _attention_forward_for(backend: str):
    def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None,
                          sliding_window=None, softcap=None, s_aux=None, **kwargs):
        """transformers' attention interface: query (B, nh, Tq, hs), key (B, nh_kv, Tk, hs), value (B, nh_kv, Tk,
        hs_v); returns ((B, Tq, nh, hs_v), None): flash kernels never form the attention weights."""
        name = type(module).__name__
        for kwarg in _UNSUPPORTED_KWARGS:
            if kwargs.get(kwarg) is not None:
                raise ValueError(f"{name} passes {kwarg}, which nanoflash attention does not support; "
                                 'use attn_implementation="sdpa" or "eager"')
        B, Hq, Tq, Tk = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        # as in transformers' sdpa: a per-call is_causal overrides the module's
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        left = _window_left(name, sliding_window, causal)
        # a window as long as the keys cuts nothing: dropping it keeps the unmasked paths (one query, say)
        call = dict(scale=scaling, left=left if left < Tk - 1 else -1,
                    terms=_terms(name, Hq, softcap, s_aux, dropout), backend=backend)
        documents = _given_sequences(kwargs, B, Tq, Tk)  # cu_seq_lens_q/k
        if attention_mask is not None and tuple(attention_mask.shape) == (B, Tk):
            # our mask builder's padding mask: it comes only for a padded batch under the causal mask
            if documents is not None:
                raise ValueError("nanoflash attention got both a padding mask and cu_seq_lens_q/k; pack the sequences "
                                 "without padding (one row, no attention_mask) or pad them without cu_seq_lens")
            plan = kept_per_tensor(attention_mask, ("hf padding", Tq), lambda: _padding_plan(attention_mask, Tq))
            return _varlen(query, key, value, plan, **call), None

        if attention_mask is None:
            plan = _DENSE
        else:  # a 4-D mask: read once per forward pass (every layer gets the same tensor) into what it asks for
            plan = _mask_plan(attention_mask, B, Tq, Tk, call["left"]) if causal else None
            if plan is None:
                raise ValueError(
                    f"{name} got an attention_mask other than those nanoflash attention computes (causal, within "
                    "the sliding window, within each packed sequence, padded keys left out): a custom 4-D mask; "
                    'use attn_implementation="sdpa"'
                )
        if plan is _DENSE and documents is None and causal:
            # a causal mask over whole rows, or none: restarting position_ids still tell packed sequences, as in
            # transformers' FlashAttention-2 path (its mask builders see them only without a KV cache, and some
            # models, gpt-oss among them, never pass them on)
            documents = _restarting_positions(kwargs, B, Tq, Tk)
        if documents is not None:
            if not causal:
                raise ValueError(f"{name} is not causal but gets packed sequences; nanoflash attention packs "
                                 'causal attention only: use attn_implementation="sdpa"')
            if plan is not _DENSE and not _same_rows(plan, documents):
                raise ValueError("cu_seq_lens_q/k describe other sequences than the attention_mask does; pass "
                                 "one of them, or both from the same packing")
            plan = documents
        if plan is _DENSE:
            if attention_mask is None and causal and 1 < Tq < Tk:
                # transformers only skips the mask here when the keys past Tq are unwritten static-cache
                # slots (top-left alignment); our causal is bottom-right and would attend to them
                raise ValueError(
                    "nanoflash attention got no mask for a query block shorter than the keys (a static KV "
                    'cache prefill); use the default dynamic cache or attn_implementation="sdpa"'
                )
            return _dense(query, key, value, causal, **call), None
        return _varlen(query, key, value, plan, **call), None

    return attention_forward


def _window_left(name: str, sliding_window, causal: bool) -> int:
    """transformers' sliding_window=w: query i sees keys j with i - w < j <= i (its mask's kv_idx > q_idx - w), so
    w keys, itself included: our window=(w - 1, 0). -> w - 1, or -1 for no window."""
    if sliding_window is None:
        return -1
    if not (isinstance(sliding_window, int) and not isinstance(sliding_window, bool) and sliding_window >= 1):
        raise ValueError(f"{name} passes sliding_window={sliding_window!r}; nanoflash attention takes a window of "
                         'an int >= 1 tokens: use attn_implementation="sdpa"')
    if not causal:
        raise ValueError(f"{name} passes sliding_window={sliding_window} to bidirectional attention, whose window "
                         'nanoflash attention does not map; use attn_implementation="sdpa"')
    return sliding_window - 1


def _terms(name: str, heads: int, softcap, s_aux, dropout: float) -> dict:
    """The model's softcap (Gemma 2's attn_logit_softcapping; None: off), s_aux (gpt-oss's sink logit per query
    head, a parameter of shape (heads,)) and attention dropout (transformers passes the config's in training, 0 in
    eval) as attention()'s softcap=, sinks= and dropout_p=."""
    if s_aux is not None and not (isinstance(s_aux, torch.Tensor) and tuple(s_aux.shape) == (heads,)):
        shape = tuple(s_aux.shape) if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__
        raise ValueError(f"{name} passes s_aux of shape {shape}; nanoflash attention takes one sink logit per query "
                         f'head, ({heads},): use attn_implementation="sdpa" or "eager"')
    return dict(softcap=float(softcap or 0.0), sinks=s_aux, dropout_p=float(dropout or 0.0))


def _dense(query, key, value, causal: bool, scale, left: int, terms: dict, backend: str) -> torch.Tensor:
    """attention() on the (B, nh, T, hs) tensors as they are -> (B, Tq, nh, hs_v)."""
    window = (left, 0) if left >= 0 else None
    y = attention(query, key, value, causal=causal, scale=scale, backend=backend, window=window, **terms)
    # (B, nh, Tq, hs) -> (B, Tq, nh, hs); contiguous() is free for the Triton backend, whose
    # output already lies in (B, T, nh, hs) order, and models may .view() the result
    return y.transpose(1, 2).contiguous()


class _Rows:
    """Sequences of a batch for attention_varlen: the (batch, position) indices of their queries and of their
    keys, sequence after sequence, their cu_seqlens (n + 1,) int32 and longest lengths."""

    def __init__(self, rows_q, cu_q, max_q, rows_k=None, cu_k=None, max_k=None):
        self.rows_q, self.cu_q, self.max_q = rows_q, cu_q, int(max_q)
        self.rows_k = rows_q if rows_k is None else rows_k
        self.cu_k = cu_q if cu_k is None else cu_k
        self.max_k = self.max_q if max_k is None else int(max_k)


_DENSE = object()  # a 4-D mask that is the causal one (within the window) for every row: attention() as it is


def _varlen(query, key, value, plan: _Rows, scale, left: int, terms: dict, backend: str) -> torch.Tensor:
    """Causal attention within each sequence of `plan`: its tokens packed end to end into attention_varlen, the
    output scattered back. query (B, nh, Tq, hs), key/value (B, nh_kv, Tk, hs / hs_v). Within a sequence varlen's
    bottom-right alignment puts its last query at its last key (a KV cache continues the sequences).
    -> (B, Tq, nh, hs_v), 0 at queries of no sequence (padding)."""
    B, nh, Tq, _ = query.shape
    # (B, nh, T, hs) -> (B, T, nh, hs) -> the (total, nh, hs) rows of the tokens
    q, k, v = (t.transpose(1, 2)[rows] for t, rows in ((query, plan.rows_q), (key, plan.rows_k),
                                                        (value, plan.rows_k)))
    y = attention_varlen(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, softmax_scale=scale, causal=True,
                         window_size=(left, 0) if left >= 0 else (-1, -1), backend=backend, **terms)
    return y.new_zeros(B, Tq, nh, y.shape[-1]).index_put(plan.rows_q, y)


def _padding_plan(padding_mask, Tq: int) -> _Rows:
    """(B, Tk) padding mask, True at tokens, one sequence per row. The queries are the last Tq positions of the
    keys, so their mask is the last Tq columns."""
    rows_k, cu_k, max_k = _packed_rows(padding_mask)
    if Tq == padding_mask.shape[1]:
        return _Rows(rows_k, cu_k, max_k)
    return _Rows(*_packed_rows(padding_mask[:, -Tq:]), rows_k, cu_k, max_k)


def _packed_rows(padding_mask):
    """(B, T) padding mask -> the (batch, position) indices of its tokens, row after row, the cu_seqlens of
    the rows (B + 1,) int32 and the longest row's token count."""
    lengths = padding_mask.sum(-1, dtype=torch.int32)
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return padding_mask.nonzero(as_tuple=True), cu_seqlens, int(lengths.max())


def _sequences(tokens, starts) -> _Rows:
    """(B, T) bool tokens and the tokens that start a sequence -> the sequences (Tq == Tk), in row order."""
    rows = tokens.nonzero(as_tuple=True)
    sequence = starts.flatten().cumsum(0).view(starts.shape) - 1  # the sequence of each token
    lengths = torch.bincount(sequence[rows], minlength=int(starts.sum())).to(torch.int32)
    cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return _Rows(rows, cu, int(lengths.max()) if lengths.numel() else 0)


def _given_sequences(kwargs, B: int, Tq: int, Tk: int) -> _Rows | None:
    """The packed sequences cu_seq_lens_q/k (and max_length_q/k) name, as DataCollatorWithFlattening makes them
    (return_flash_attn_kwargs=True), or None."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None or B != 1 or Tq != Tk:
        _refuse_cu_seq_lens(cu_q, cu_k, B, Tq, Tk)
    # read once per tensor: every layer of a forward pass gets the same ones
    return kept_per_tensor(cu_q, ("hf cu_seq_lens", id(cu_k), Tq), lambda: _cu_rows(cu_q, cu_k, Tq, kwargs))


def _cu_rows(cu_q, cu_k, T: int, kwargs) -> _Rows:
    """One row of T tokens holding the sequences of cu_seq_lens_q (== cu_seq_lens_k)."""
    if not torch.equal(cu_q, cu_k):
        _refuse_cu_seq_lens(cu_q, cu_k, 1, T, T)
    cu = cu_q.to(torch.int32)
    longest = kwargs.get("max_length_q")
    longest = int(cu.diff().max()) if longest is None else int(longest)
    return _Rows((torch.zeros(T, dtype=torch.long, device=cu.device), torch.arange(T, device=cu.device)), cu, longest)


def _refuse_cu_seq_lens(cu_q, cu_k, B: int, Tq: int, Tk: int):
    given = {name: "given" if cu is not None else "None" for name, cu in (("q", cu_q), ("k", cu_k))}
    raise ValueError(
        "nanoflash attention takes cu_seq_lens_q/k for sequences packed in one row without a KV cache, both the same; "
        f"got batch {B}, {Tq} queries, {Tk} keys, cu_seq_lens_q {given['q']}, cu_seq_lens_k {given['k']}"
    )


def _restarting_positions(kwargs, B: int, Tq: int, Tk: int) -> _Rows | None:
    """The packed sequences position_ids tell where they restart, read once per tensor, or None."""
    positions = kwargs.get("position_ids")
    if positions is None or Tq != Tk or Tq < 2 or positions.dim() != 2 or positions.shape[-1] != Tq:
        return None
    return kept_per_tensor(positions, ("hf sequences", B), lambda: _restarting(positions.expand(B, -1)))


def _restarting(positions) -> _Rows | None:
    """(B, T) position_ids -> the sequences they hold, one wherever a position is not its predecessor's + 1, or
    None if every row is one sequence."""
    starts = F.pad(positions.diff(dim=-1) != 1, (1, 0), value=True)
    if not starts[:, 1:].any():
        return None
    return _sequences(torch.ones_like(starts), starts)


def _mask_plan(mask, B: int, Tq: int, Tk: int, left: int):
    """A 4-D mask read once per tensor (kept_per_tensor): every layer of a forward pass gets the same one."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[-2:]) != (Tq, Tk):
        return None
    return kept_per_tensor(mask, ("hf mask", B, left), lambda: _read_mask(mask, B, Tq, Tk, left))


def _read_mask(mask, B: int, Tq: int, Tk: int, left: int):
    """What a (B or 1, nh or 1, Tq, Tk) mask (bool: True = attend, or additive float: 0 / -inf or the dtype's
    lowest value) asks for, if it is one of ours, else None. _DENSE: for every row and head, the causal mask
    (bottom-right, as transformers builds it for queries that continue a KV cache) within the window. _Rows: with
    a KV cache (Tq < Tk) padded rows (_read_cached_mask); without (Tq == Tk) sequences, each a run of tokens (a
    position that attends to itself) whose queries see the earlier tokens of their run within the window, and only
    those; the queries of padding are free (their outputs are 0 and no token reads them)."""
    if mask.dtype == torch.bool:
        attends = mask
    elif mask.is_floating_point():
        attends = mask == 0
        if not (attends | torch.isneginf(mask) | (mask == torch.finfo(mask.dtype).min)).all():
            return None  # a bias, not a mask
    else:
        return None
    if mask.shape[0] not in (1, B) or (mask.shape[1] > 1 and not (attends == attends[:, :1]).all()):
        return None  # a mask per head
    attends = attends[:, 0].expand(B, Tq, Tk)
    visible = causal_mask(Tq, Tk, device=mask.device)
    if left >= 0:
        visible &= window_mask(Tq, Tk, (left, 0), device=mask.device)
    if bool((attends == visible).all()):
        return _DENSE
    if Tq != Tk:
        return _read_cached_mask(attends, Tq, Tk, visible)
    # a token starts a sequence unless it attends to the token before it; a window of one key (left 0) shows no
    # boundaries, and needs none: every query sees itself alone
    tokens = attends.diagonal(dim1=-2, dim2=-1)
    starts = tokens.clone()
    starts[:, 1:] &= ~(tokens[:, :-1] & attends.diagonal(offset=-1, dim1=-2, dim2=-1))
    sequence = (starts.flatten().cumsum(0).view(B, Tq) - 1).masked_fill(~tokens, -1)
    expected = (sequence[:, :, None] == sequence[:, None, :]) & tokens[:, None, :] & visible
    if not bool(((attends == expected) | ~tokens[:, :, None]).all()):
        return None
    return _sequences(tokens, starts)


def _read_cached_mask(attends, Tq: int, Tk: int, visible) -> _Rows | None:
    """A (B, Tq, Tk) mask of queries that continue a KV cache (Tq < Tk) on a padded batch, or None: one sequence per
    row, its keys those some query sees (a key out of every query's window may be left out: no query reads it), its
    queries those that see themselves, both runs of positions that end at the same one, so that attention_varlen's
    bottom-right alignment gives every query its distance to every key."""
    q_tokens = attends.diagonal(offset=Tk - Tq, dim1=-2, dim2=-1)  # (B, Tq)
    k_tokens = attends.any(dim=1)  # (B, Tk)
    if not bool(((attends == (visible & k_tokens[:, None, :])) | ~q_tokens[:, :, None]).all()):
        return None
    q_ends, k_ends = _run_ends(q_tokens, Tk - Tq), _run_ends(k_tokens, 0)
    if q_ends is None or k_ends is None or not bool(((q_ends == k_ends) | ~q_tokens.any(-1)).all()):
        return None
    return _Rows(*_packed_rows(q_tokens), *_packed_rows(k_tokens))


def _run_ends(tokens, first_position: int):
    """(B, n) bool -> the position after each row's last token, if every row's tokens are one run, else None."""
    position = torch.arange(tokens.shape[1], device=tokens.device) + first_position
    count = tokens.sum(-1)
    end = torch.where(tokens, position + 1, 0).amax(-1)
    start = torch.where(tokens, position, position[-1] + 1).amin(-1)
    return end if bool(((count == 0) | (end - start == count)).all()) else None


def _same_rows(plan: _Rows, documents: _Rows) -> bool:
    """True if the sequences a mask describes are cu_seq_lens' (one row, no padding)."""
    return plan.rows_q[0].numel() == documents.rows_q[0].numel() and torch.equal(plan.cu_q, documents.cu_q)
