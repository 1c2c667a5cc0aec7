"""nanoflash attention inside tiny random Hugging Face models matches the same models on sdpa."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from integrations.transformers import register  # noqa: E402

T = 24


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


def _model(config, attn_implementation):
    torch.manual_seed(0)  # same seed: same weights for every implementation
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def _input_ids(batch=2, seq_len=T):  # token 0 is left out: generate() takes it for padding
    return torch.randint(1, 96, (batch, seq_len), generator=torch.Generator().manual_seed(1))


def _logits_and_grads(model, input_ids, **kwargs):
    model.train()
    logits = model(input_ids, **kwargs).logits
    # a loss that weighs every logit differently, so every attention output gets its own gradient
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_name", list(CONFIGS))
@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_logits_and_gradients_match_sdpa(model_name, backend):
    config = CONFIGS[model_name]()
    input_ids = _input_ids()
    expected_logits, expected_grads = _logits_and_grads(_model(config, "sdpa"), input_ids)
    logits, grads = _logits_and_grads(_model(config, register(backend)), input_ids)
    _assert_close_to_scale(logits, expected_logits, "logits")
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        _assert_close_to_scale(grad, expected_grads[name], name)


def _assert_close_to_scale(got, expected, name):
    # fp32 rounding differences between kernels are ~1e-7 of a tensor's largest entry (measured
    # <= 5e-7 here); a wrong scale, mask or head mapping is off by order 1
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, atol=1e-5 * scale, rtol=0, msg=lambda m: f"{name}: {m}")


def test_kv_cache_continuation_matches_one_pass():
    """A second block of queries against a cache gets a materialised causal mask (Tq < Tk): accepted."""
    model = _model(_llama_config(), register("naive")).eval()
    input_ids = _input_ids()
    with torch.no_grad():
        full = model(input_ids).logits
        first = model(input_ids[:, :16], use_cache=True)
        rest = model(input_ids[:, 16:], past_key_values=first.past_key_values).logits
    torch.testing.assert_close(rest, full[:, 16:], atol=1e-5, rtol=1e-5)


def test_generate_matches_sdpa():
    prompt = _input_ids(seq_len=8)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = _model(_llama_config(), "sdpa").eval().generate(prompt, **kwargs)
    assert torch.equal(_model(_llama_config(), register("naive")).eval().generate(prompt, **kwargs), expected)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_explicit_causal_4d_mask_is_accepted(dtype):
    model = _model(_llama_config(), register("naive")).eval()
    input_ids = _input_ids()
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(2, 1, T, T)
    mask = causal if dtype == torch.bool else torch.zeros(2, 1, T, T).masked_fill(~causal, torch.finfo(dtype).min)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids, attention_mask=mask).logits, model(input_ids).logits)


@pytest.mark.parametrize("model_name", list(CONFIGS))
def test_padding_mask_raises(model_name):
    model = _model(CONFIGS[model_name](), register("naive"))
    attention_mask = torch.ones(2, T, dtype=torch.long)
    attention_mask[0, :5] = 0  # left padding in the first row
    with pytest.raises(ValueError, match="padding.*sdpa"):
        model(_input_ids(), attention_mask=attention_mask)


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
