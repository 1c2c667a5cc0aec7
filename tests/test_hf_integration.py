"""nanoflash attention inside tiny random Hugging Face models matches the same models on sdpa."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from attention.integrations.transformers import register  # noqa: E402

T = 24
PADDED_T = 11  # padded batches: rows of 2, 11 and 7 tokens (_padding_mask)


def _llama_config():  # grouped-query attention: 4 query heads share 2 k/v heads, head dim 16
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )


def _gpt2_config(attn_pdrop=0.0):  # scaled by 1/(layer + 1): the module's own scaling must be used
    return transformers.GPT2Config(
        vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64, scale_attn_by_inverse_layer_idx=True,
        attn_pdrop=attn_pdrop, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )


CONFIGS = {"llama": _llama_config, "gpt2": _gpt2_config}


def _model(config, attn_implementation, dtype=torch.float32):
    torch.manual_seed(0)  # same seed: same weights for every implementation
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).to(dtype)


def _input_ids(batch=2, seq_len=T):  # token 0 is left out: generate() takes it for padding
    return torch.randint(1, 96, (batch, seq_len), generator=torch.Generator().manual_seed(1))


def _padding_mask(side, seq_len=PADDED_T):
    """(3, seq_len) attention_mask, 1 at tokens: a heavily padded row of 2 tokens, a full row, a row of
    seq_len - 4, the padding on the given side."""
    mask = torch.zeros(3, seq_len, dtype=torch.long)
    for row, length in enumerate((2, seq_len, seq_len - 4)):
        mask[row, slice(seq_len - length, None) if side == "left" else slice(length)] = 1
    return mask


def _logits_and_grads(model, input_ids, attention_mask=None):
    """-> {"logits": the logits at tokens, parameter name: its gradient}. Padded positions are left out of both:
    their outputs differ between implementations (ours are 0) and no token attends to them."""
    model.train()
    logits = model(input_ids, attention_mask=attention_mask).logits
    logits = logits[attention_mask.bool()] if attention_mask is not None else logits
    # a loss that weighs every logit differently, so every attention output gets its own gradient
    (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
    return {"logits": logits.detach(), **{n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("model_name", list(CONFIGS))
@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_logits_and_gradients_match_sdpa(model_name, backend):
    config = CONFIGS[model_name]()
    expected = _logits_and_grads(_model(config, "sdpa"), _input_ids())
    got = _logits_and_grads(_model(config, register(backend)), _input_ids())
    assert got.keys() == expected.keys()
    for name in expected:
        _assert_close_to_scale(got[name], expected[name], name)


def _assert_close_to_scale(got, expected, name):
    # fp32 rounding differences between kernels are ~1e-7 of a tensor's largest entry (measured
    # <= 5e-7 here); a wrong scale, mask or head mapping is off by order 1
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, atol=1e-5 * scale, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend, dtype", [("naive", torch.float64), ("triton", torch.float32)])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("model_name", list(CONFIGS))
def test_padded_batch_matches_sdpa(model_name, side, backend, dtype):
    """Padded rows go through attention_varlen: logits at tokens and every gradient match sdpa's."""
    config = CONFIGS[model_name]()
    input_ids, attention_mask = _input_ids(batch=3, seq_len=PADDED_T), _padding_mask(side)
    exact = _logits_and_grads(_model(config, "sdpa", torch.float64), input_ids, attention_mask)
    sdpa = _logits_and_grads(_model(config, "sdpa", dtype), input_ids, attention_mask)
    got = _logits_and_grads(_model(config, register(backend), dtype), input_ids, attention_mask)
    assert got.keys() == exact.keys()
    for name in exact:
        # as close to the float64 answer as sdpa in the same dtype, up to a factor 2 for rounding in another
        # order, plus 8 ulps of the tensor's scale; attending to a padded key is off by order 1
        sdpa_error = (sdpa[name] - exact[name]).abs().max().item()
        ulps = 8 * torch.finfo(dtype).eps * exact[name].abs().max().item()
        torch.testing.assert_close(got[name].double(), exact[name], atol=2 * sdpa_error + ulps, rtol=0,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("side", [None, "left", "right"])
def test_kv_cache_continuation_matches_one_pass(side):
    """A second block of queries against a cache: without padding it gets a materialised causal mask (Tq < Tk),
    with padding the padding mask, whose last Tq columns are the queries'. The first block leaves the left-padded
    row without a token and the second block leaves the right-padded row without one."""
    model = _model(_llama_config(), register("naive")).eval()
    input_ids, mask = _input_ids(batch=3), None if side is None else _padding_mask(side, seq_len=T)
    tokens = torch.ones(3, T, dtype=torch.bool) if mask is None else mask.bool()
    with torch.no_grad():
        full = model(input_ids, attention_mask=mask).logits
        first = model(input_ids[:, :16], attention_mask=None if mask is None else mask[:, :16], use_cache=True)
        rest = model(input_ids[:, 16:], attention_mask=mask, cache=first.cache).logits
    torch.testing.assert_close(rest[tokens[:, 16:]], full[:, 16:][tokens[:, 16:]], atol=1e-5, rtol=1e-5)


def test_generate_matches_sdpa():
    prompt = _input_ids(seq_len=8)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = _model(_llama_config(), "sdpa").eval().generate(prompt, **kwargs)
    assert torch.equal(_model(_llama_config(), register("naive")).eval().generate(prompt, **kwargs), expected)


@pytest.mark.parametrize("model_name, backend", [("llama", "naive"), ("gpt2", "naive"), ("llama", "triton")])
def test_generate_left_padded_matches_sdpa(model_name, backend):
    """A left-padded batch through the KV cache: the prompt unpadded, then every new token (Tq = 1) against
    its row's tokens. The step logits are compared too: the tiny GPT-2 repeats its last token whatever it
    attends to."""
    attention_mask = _padding_mask("left", seq_len=9)
    prompt = _input_ids(batch=3, seq_len=9) * attention_mask  # 0: the pad token
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    expected = _model(CONFIGS[model_name](), "sdpa").eval().generate(prompt, **kwargs)
    got = _model(CONFIGS[model_name](), register(backend)).eval().generate(prompt, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    _assert_close_to_scale(torch.stack(got.logits), torch.stack(expected.logits), "step logits")


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_explicit_causal_4d_mask_is_accepted(dtype):
    model = _model(_llama_config(), register("naive")).eval()
    input_ids = _input_ids()
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(2, 1, T, T)
    mask = causal if dtype == torch.bool else torch.zeros(2, 1, T, T).masked_fill(~causal, torch.finfo(dtype).min)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids, attention_mask=mask).logits, model(input_ids).logits)


def test_custom_4d_mask_raises():
    """A 4-D mask is taken only if it is the causal mask; this one also hides the first row's first 5 keys."""
    model = _model(_llama_config(), register("naive"))
    mask = torch.ones(T, T, dtype=torch.bool).tril().repeat(2, 1, 1, 1)
    mask[0, :, :, :5] = False
    with pytest.raises(ValueError, match="custom 4-D mask.*sdpa"):
        model(_input_ids(), attention_mask=mask)


@pytest.mark.parametrize("model_name", list(CONFIGS))
def test_packed_sequences_raise(model_name):
    """Two sequences packed in one row, told apart by position_ids that restart: without a cache transformers
    builds a block-diagonal mask, which we refuse."""
    model = _model(CONFIGS[model_name](), register("naive"))
    position_ids = torch.cat([torch.arange(10), torch.arange(T - 10)])[None]
    with pytest.raises(ValueError, match="packed sequences.*sdpa"):
        model(_input_ids(batch=1), position_ids=position_ids, use_cache=False)


def test_attention_dropout_in_training_raises():
    model = _model(_gpt2_config(attn_pdrop=0.1), register("naive")).train()
    with pytest.raises(ValueError, match="dropout.*sdpa"):
        model(_input_ids())
    with torch.no_grad():  # in eval mode transformers passes dropout=0: fine
        model.eval()(_input_ids())


def test_registering_twice_is_harmless():
    assert register("naive") == register("naive") == "nanoattn_naive"
    assert list(transformers.AttentionInterface._global_mapping).count("nanoattn_naive") == 1
    model = _model(_llama_config(), "nanoattn_naive").eval()
    with torch.no_grad():
        expected = _model(_llama_config(), "sdpa").eval()(_input_ids()).logits
        torch.testing.assert_close(model(_input_ids()).logits, expected, atol=1e-5, rtol=1e-5)


def test_bad_backend_or_name_raises():
    with pytest.raises(ValueError, match="unknown attention backend"):
        register("nope")
    with pytest.raises(ValueError, match="flash"):
        register("triton", name="my_flash")  # transformers would go looking for the flash-attn package
