"""nanoflash attention inside tiny random Hugging Face models matches the same models on sdpa or eager."""
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


def _logits_and_grads(model, input_ids, attention_mask=None, train=True):
    """-> {"logits": the logits at tokens, parameter name: its gradient (of those that get one: a mixture of experts
    may leave some out)}. Padded positions are left out of both: their outputs differ between implementations (ours
    are 0) and no token attends to them. train=False: the backward in eval mode (no dropout)."""
    model.train(train)
    logits = model(input_ids, attention_mask=attention_mask).logits
    logits = logits[attention_mask.bool()] if attention_mask is not None else logits
    # a loss that weighs every logit differently, so every attention output gets its own gradient
    (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
    return {"logits": logits.detach(), **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


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
    _assert_generate_matches(CONFIGS[model_name], "sdpa", backend, _padding_mask("left", seq_len=9), 6)


def _assert_generate_matches(config, reference, backend, attention_mask, max_new_tokens):
    """Greedy generate() from the (3, 9) prompt under `reference` and ours: the same tokens, close step logits."""
    prompt = _input_ids(batch=3, seq_len=9) * attention_mask  # 0: the pad token
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    expected = _model(config(), reference).eval().generate(prompt, **kwargs)
    got = _model(config(), register(backend)).eval().generate(prompt, **kwargs)
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
    """A 4-D mask is taken only if it is one of ours (causal, windowed, packed, padded); this one also hides the first
    row's first 5 keys from its queries from 12 on. (Hiding them from every query would be left padding.)"""
    model = _model(_llama_config(), register("naive"))
    mask = torch.ones(T, T, dtype=torch.bool).tril().repeat(2, 1, 1, 1)
    mask[0, :, 12:, :5] = False
    with pytest.raises(ValueError, match="custom 4-D mask.*sdpa"):
        model(_input_ids(), attention_mask=mask)


@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_attention_dropout_in_training_reaches_the_kernels(backend):
    # GPT-2's attn_pdrop: transformers passes it in training (0 in eval), and it becomes attention()'s dropout_p
    from attention.flash import dropout
    torch.manual_seed(0)
    model = _model(_gpt2_config(attn_pdrop=0.5), register(backend))
    with torch.no_grad():
        evaluated = model.eval()(_input_ids()).logits
        assert torch.equal(model(_input_ids()).logits, evaluated)  # eval: no dropout
    model.train()
    with dropout.recording() as seeds:
        first = model(_input_ids()).logits
    assert not torch.allclose(first, evaluated, atol=1e-3)  # probabilities dropped
    first.sum().backward()  # and it trains
    if backend == "triton":
        assert len(seeds) == model.config.n_layer  # a mask per layer, drawn by the kernels' path
    torch.manual_seed(1)
    second = model(_input_ids()).logits
    torch.manual_seed(1)
    assert torch.equal(model(_input_ids()).logits, second)  # torch.manual_seed reproduces the masks


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


# issue 47: models whose attention has softcapping, sinks, a sliding window or a value head dim of its own
WINDOW = 7  # the sliding window, shorter than the sequences: it cuts


def _model_class(name):
    """transformers' config class for `name`, or a skip if the installed transformers lacks the model."""
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return cls


def _gemma2_config():  # softcap on the scores, a sliding window on every other layer, GQA
    return _model_class("Gemma2Config")(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=64,
        sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=None,
    )


def _gpt_oss_config():  # a learned sink logit per head (s_aux), a sliding window on every other layer, GQA
    return _model_class("GptOssConfig")(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=WINDOW,
        num_local_experts=4, num_experts_per_tok=2,
    )


def _deepseek_v3_config():  # MLA: k/q head dim 16 + 8 = 24, v head dim 16
    return _model_class("DeepseekV3Config")(
        vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


TERM_CONFIGS = {"gpt2": lambda: _gpt2_config(attn_pdrop=0.1), "gemma2": _gemma2_config,
                "gpt_oss": _gpt_oss_config, "deepseek_v3": _deepseek_v3_config}


def test_sliding_window_convention():
    """transformers' sliding_window=w lets query i see keys i - w < j <= i: our window=(w - 1, 0)."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    from attention.masks import dense_mask
    for w in (1, 2, 5):
        theirs = sdpa_mask(batch_size=1, q_length=12, kv_length=12, allow_is_causal_skip=False,
                           mask_function=sliding_window_causal_mask_function(w))
        assert torch.equal(theirs[0, 0], dense_mask(12, 12, causal=True, window=(w - 1, 0))[0, 0]), w


@pytest.mark.parametrize("model_name", list(TERM_CONFIGS))
@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_term_models_match_eager(model_name, backend):
    """Softcap (Gemma 2), sinks (gpt-oss), sliding windows (both), MLA's value head dim (DeepSeek-V3), GPT-2
    with attention dropout in its config: eval-mode logits and a training step's gradients equal eager's, the
    sinks' gradient among them."""
    config = TERM_CONFIGS[model_name]()
    train = model_name != "gpt2"  # GPT-2: attn_pdrop=0.1 is refused in training; its backward runs in eval mode
    with torch.no_grad():
        eager_logits = _model(config, "eager").eval()(_input_ids()).logits
        ours_logits = _model(config, register(backend)).eval()(_input_ids()).logits
    _assert_close_to_scale(ours_logits, eager_logits, "eval logits")
    expected = _logits_and_grads(_model(config, "eager"), _input_ids(), train=train)
    got = _logits_and_grads(_model(config, register(backend)), _input_ids(), train=train)
    assert got.keys() == expected.keys()
    if model_name == "gpt_oss":
        assert "model.layers.0.self_attn.sinks" in got and got["model.layers.0.self_attn.sinks"].abs().max() > 0
    for name in expected:
        _assert_close_to_scale(got[name], expected[name], name)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("model_name", ["gemma2", "gpt_oss"])
def test_padded_batch_with_window_matches_eager(model_name, side):
    """Padding on the sliding-window layers: transformers' 4-D mask is read into the rows' tokens, which go
    through attention_varlen with the window."""
    config = TERM_CONFIGS[model_name]()
    input_ids, attention_mask = _input_ids(batch=3, seq_len=PADDED_T + 3), _padding_mask(side, PADDED_T + 3)
    expected = _logits_and_grads(_model(config, "eager"), input_ids, attention_mask)
    got = _logits_and_grads(_model(config, register("triton")), input_ids, attention_mask)
    for name in expected:
        _assert_close_to_scale(got[name], expected[name], name)


PACKED = (9, 5, 10)  # three sequences in one row of T = 24 tokens


def _packed_vs_alone(model, **kwargs):
    """Logits of the PACKED sequences in one row (position_ids restart at each) and of each run alone."""
    input_ids = _input_ids(batch=1)
    position_ids = torch.cat([torch.arange(n) for n in PACKED])[None]
    with torch.no_grad():
        packed = model(input_ids, position_ids=position_ids, **kwargs).logits[0]
        starts = [0, *torch.tensor(PACKED).cumsum(0).tolist()]
        alone = torch.cat([model(input_ids[:, a:b], use_cache=False).logits[0] for a, b in zip(starts, starts[1:])])
    return packed, alone


@pytest.mark.parametrize("model_name, backend", [
    *((name, "naive") for name in ("llama", "gpt2", "gemma2", "gpt_oss", "deepseek_v3")),
    *((name, "triton") for name in ("gemma2", "gpt_oss", "deepseek_v3")),
])
def test_packed_rows_match_sequences_alone(model_name, backend):
    """use_cache=False: transformers builds a block-diagonal mask from the restarting position_ids (a window
    within it on Gemma 2's sliding layers); it is read into the sequences, run through attention_varlen. gpt-oss
    passes no position_ids to its mask builders, so its masks are causal (eager attends across the sequences); the
    position_ids its layers pass to attention tell the sequences, as on transformers' FlashAttention-2 path."""
    config = {**CONFIGS, **TERM_CONFIGS}[model_name]()
    packed, alone = _packed_vs_alone(_model(config, register(backend)).eval(), use_cache=False)
    _assert_close_to_scale(packed, alone, "packed logits")


@pytest.mark.parametrize("model_name", ["llama", "gemma2"])
def test_packed_rows_without_mask_read_position_ids(model_name):
    """With a KV cache transformers builds no packed mask (eager then attends across the sequences); as its
    FlashAttention-2 path, we read the restarting position_ids the model passes to attention."""
    config = {**CONFIGS, **TERM_CONFIGS}[model_name]()
    packed, alone = _packed_vs_alone(_model(config, register("naive")).eval(), use_cache=True)
    _assert_close_to_scale(packed, alone, "packed logits")


def test_packed_rows_from_cu_seq_lens():
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True)'s cu_seq_lens_q/k, without position_ids: the
    mask is causal, the sequences come from cu_seq_lens alone."""
    model = _model(_gemma2_config(), register("triton")).eval()
    cu = torch.tensor([0, *torch.tensor(PACKED).cumsum(0).tolist()], dtype=torch.int32)
    kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(PACKED), max_length_k=max(PACKED))
    input_ids = _input_ids(batch=1)
    with torch.no_grad():
        packed = model(input_ids, use_cache=False, **kwargs).logits[0]
    _, alone = _packed_vs_alone(model, use_cache=False)
    _assert_close_to_scale(packed, alone, "packed logits")
    with pytest.raises(ValueError, match="cu_seq_lens_q/k for sequences packed in one row"):
        model(_input_ids(), use_cache=False, **kwargs)  # two rows


def test_sinks_of_another_shape_raise():
    from attention.integrations.transformers import _terms

    with pytest.raises(ValueError, match=r"s_aux of shape \(2, 4\).*\(4,\)"):
        _terms("GptOssAttention", 4, None, torch.zeros(2, 4), 0.0)


@pytest.mark.parametrize("model_name, backend", [("gemma2", "naive"), ("gpt_oss", "naive"), ("gpt_oss", "triton"),
                                                 ("deepseek_v3", "naive")])
@pytest.mark.parametrize("side", [None, "left"])
def test_generate_with_terms_matches_eager(model_name, backend, side):
    """generate() through the KV cache, past the sliding window (9 + 8 tokens > WINDOW): the sliding layers' cache
    keeps the window's keys, the masks of the steps are read into attention() or, padded, attention_varlen."""
    attention_mask = _padding_mask("left", seq_len=9) if side else torch.ones(3, 9, dtype=torch.long)
    _assert_generate_matches(TERM_CONFIGS[model_name], "eager", backend, attention_mask, 8)


def test_backend_without_a_term_raises():
    """A backend that lacks a model's term says so in one line and names those that compute it."""
    model = _model(_gemma2_config(), register("sdpa", name="nanoattn_torch")).eval()
    with pytest.raises(ValueError, match="does not compute softcap; use one of: .*triton"):
        model(_input_ids())
