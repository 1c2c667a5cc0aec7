"""model.py: GPT-2's shapes and parameter counts, Hugging Face weights (pretrained.py), every backend giving the same
model, the attention settings of GPTConfig (window, a backend's options, sparsity) and what they change."""
import json
import math
import re

import pytest
import torch
from helpers import random_tokens, registered_backend

import attention
import model as model_module
from attention.masks import causal_mask, window_mask
from attention.moba.reference import moba_attention
from attention.reference.naive import naive_attention
from generation import KVCache
from model import GPT, GPTConfig
from pretrained import load_hf_state_dict

# tiny but with every feature: 2 layers, 3 heads of 16 channels (the smallest head tl.dot takes), GPT-2's vocabulary
TINY = dict(block_size=16, vocab_size=50257, n_layer=2, n_head=3, n_embd=48)


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides})).eval()


def tokens(B=2, T=12, seed=1):
    return random_tokens(B, T, TINY["vocab_size"], seed)


def test_124M_parameter_count():
    # counted by hand: tied wte 50304*768 + wpe 1024*768 + 12 blocks of 7,087,872 + ln_f 1536
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("124M"))
    assert model.num_params() == 124_475_904
    assert model.flops_per_token() == 6 * 124_475_904 + 12 * 12 * 768 * 1024


@pytest.mark.parametrize("name, hf_count", [
    ("gpt2", 124_439_808), ("350M", 354_823_168), ("gpt2-large", 774_030_080), ("1.5B", 1_557_611_200),
])
def test_preset_parameter_counts_match_openai_gpt2(name, hf_count):
    # the published sizes of OpenAI's checkpoints (vocab 50257); meta tensors allocate nothing
    with torch.device("meta"):
        model = GPT(GPTConfig.preset(name, vocab_size=50257))
        padded = GPT(GPTConfig.preset(name))
    assert model.num_params() == hf_count
    assert padded.num_params() == hf_count + (50304 - 50257) * model.config.n_embd


def test_forward_shapes_and_initial_loss():
    model = tiny_model()
    idx = tokens()
    logits, loss = model(idx)
    assert logits.shape == (2, 12, TINY["vocab_size"]) and loss is None
    _, loss = model(idx, targets=tokens(seed=2))
    # small init makes the logits nearly uniform, so the loss starts at ln(vocab)
    assert abs(loss.item() - math.log(TINY["vocab_size"])) < 0.1


def test_dropout_acts_in_training_only():
    model = tiny_model(dropout=0.5)
    idx = tokens()
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])
    model.eval()
    torch.testing.assert_close(model(idx)[0], tiny_model()(idx)[0])  # same seed, same weights, no dropout


def test_residual_projections_get_scaled_init():
    model = GPT(GPTConfig(**{**TINY, "n_layer": 8, "n_embd": 240}))  # enough weights for a tight std
    block = model.transformer.h[0]
    expected = 0.02 / math.sqrt(2 * 8)
    assert block.attn.c_proj.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attn.c_attn.bias.abs().max().item() == 0.0
    assert model.lm_head.weight is model.transformer.wte.weight


def random_hf_gpt2():
    """A tiny transformers GPT-2 with every parameter random, biases and LayerNorms included,
    so a missing transpose or a mis-mapped bias cannot hide behind a zero init."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=TINY["block_size"], n_embd=TINY["n_embd"],
                                  n_layer=TINY["n_layer"], n_head=TINY["n_head"])
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return hf


def test_hf_weights_give_hf_logits():
    hf = random_hf_gpt2()
    model = tiny_model()
    load_hf_state_dict(model, hf.state_dict())
    idx = tokens()
    torch.testing.assert_close(model(idx)[0], hf(idx).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("file_name", ["pytorch_model.bin", "model.safetensors"])
def test_from_pretrained_local_file(tmp_path, file_name):
    hf = random_hf_gpt2()
    hf.save_pretrained(tmp_path)  # writes config.json and model.safetensors (without the tied lm_head)
    if file_name.endswith(".bin"):
        torch.save(hf.state_dict(), tmp_path / file_name)
    model = GPT.from_pretrained(str(tmp_path / file_name), attn="naive")
    assert model.config.n_head == TINY["n_head"] and model.config.attn == "naive"
    idx = tokens()
    torch.testing.assert_close(model(idx)[0], hf(idx).logits, rtol=1e-5, atol=1e-5)


def test_load_gpt2model_layout_with_mask_buffers():
    # OpenAI's original upload: GPT2Model keys (no "transformer." prefix, no lm_head) plus causal-mask buffers
    hf = random_hf_gpt2()
    sd = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(TINY["n_layer"]):
        sd[f"h.{i}.attn.bias"] = torch.ones(1, 1, TINY["block_size"], TINY["block_size"])
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    model = tiny_model()
    load_hf_state_dict(model, sd)
    idx = tokens()
    torch.testing.assert_close(model(idx)[0], hf(idx).logits, rtol=1e-5, atol=1e-5)


def test_load_hf_state_dict_rejects_mismatches():
    sd = random_hf_gpt2().state_dict()
    with pytest.raises(ValueError, match=r"transformer.wte.weight: checkpoint shape \(50257, 48\) != model shape "
                                         r"\(50304, 48\).*vocab_size=50257"):
        load_hf_state_dict(tiny_model(vocab_size=50304), sd)
    with pytest.raises(ValueError, match="bias=True"):
        load_hf_state_dict(tiny_model(bias=False), sd)


def test_a_mismatched_tensor_is_named_with_both_shapes_and_nothing_is_loaded():
    # every shape is checked before the first copy: a late mismatch must not leave a half-loaded model
    sd = random_hf_gpt2().state_dict()
    sd["transformer.ln_f.weight"] = torch.randn(40)  # after every block's weights in the state dict's order
    model = tiny_model()
    before = {name: p.clone() for name, p in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"transformer.ln_f.weight: checkpoint shape \(40,\) != model shape \(48,\)"):
        load_hf_state_dict(model, sd)
    after = model.state_dict()
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert not torch.equal(after["transformer.wte.weight"], sd["transformer.wte.weight"])  # it would have changed


def test_from_pretrained_refuses_what_is_not_a_gpt2_state_dict(tmp_path):
    with pytest.raises(ValueError, match="neither a GPT-2 name"):
        GPT.from_pretrained("no/such/file.bin")
    torch.save({"weight": torch.randn(3, 3)}, tmp_path / "other.pt")
    (tmp_path / "config.json").write_text('{"n_head": 2}')
    with pytest.raises(ValueError, match="holds no GPT-2 token and position embeddings"):
        GPT.from_pretrained(str(tmp_path / "other.pt"))


def test_a_weights_file_without_config_json_needs_n_head(tmp_path):
    # no weight shape reveals n_head: 48 channels could be 3 heads of 16 or 4 of 12, and a guess loads silently wrong
    hf = random_hf_gpt2()
    torch.save(hf.state_dict(), tmp_path / "weights.pt")
    with pytest.raises(ValueError, match=r"has no config.json beside it.*pass n_head= "
                                         r"\(GPT.from_pretrained\(path, n_head=12\)\)"):
        GPT.from_pretrained(str(tmp_path / "weights.pt"))
    model = GPT.from_pretrained(str(tmp_path / "weights.pt"), n_head=TINY["n_head"])
    assert model.config.n_head == TINY["n_head"]
    idx = tokens()
    torch.testing.assert_close(model(idx)[0], hf(idx).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config, message", [
    ({"num_attention_heads": 3}, None),  # the key a newer HF config uses
    ({"n_head": 3, "n_embd": 48}, None),
    ({"n_embd": 48}, "gives no n_head (got None)"),
    ({"n_head": "3"}, "gives no n_head (got '3')"),
    ("not json {", "is not a JSON config"),
])
def test_n_head_comes_from_the_config_json_beside_the_weights(tmp_path, config, message):
    hf = random_hf_gpt2()
    torch.save(hf.state_dict(), tmp_path / "weights.pt")
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if message is not None:
        with pytest.raises(ValueError, match=re.escape(message)):
            GPT.from_pretrained(str(tmp_path / "weights.pt"))
        # n_head= needs no config.json to read
        assert GPT.from_pretrained(str(tmp_path / "weights.pt"), n_head=3).config.n_head == 3
    else:
        model = GPT.from_pretrained(str(tmp_path / "weights.pt"))
        assert model.config.n_head == 3
        torch.testing.assert_close(model(tokens())[0], hf(tokens()).logits, rtol=1e-5, atol=1e-5)


BACKENDS = ["naive", "compile", "sdpa", "triton"]


@pytest.fixture(scope="module")
def sdpa_logits_and_grads():
    return logits_and_grads("sdpa")


def logits_and_grads(backend):
    model = tiny_model(attn=backend)
    logits, loss = model(tokens(), targets=tokens(seed=2))
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree_on_logits_and_grads(backend, sdpa_logits_and_grads):
    ref_logits, ref_grads = sdpa_logits_and_grads
    logits, grads = logits_and_grads(backend)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_attention_gets_strided_views_not_copies(monkeypatch):
    # the Triton backend reads q, k, v straight out of the c_attn output; copying them would waste memory traffic
    seen = []

    def spy(q, k, v, causal, scale):
        seen.append((q.is_contiguous(), k.is_contiguous(), v.is_contiguous(), causal))
        return naive_attention(q, k, v, causal, scale)

    registered_backend(monkeypatch, "spy", spy)
    tiny_model(attn="spy")(tokens())
    assert seen == [(False, False, False, True)] * TINY["n_layer"]


def test_generate_length_and_greedy():
    model = tiny_model(block_size=8)
    idx = tokens(B=2, T=5)
    out = model.generate(idx, max_new_tokens=6, top_k=5)  # runs past block_size: the context gets cropped
    assert out.shape == (2, 11) and torch.equal(out[:, :5], idx)

    greedy = idx
    for _ in range(6):
        next_token = model(greedy[:, -8:])[0][:, -1].argmax(dim=-1, keepdim=True)
        greedy = torch.cat((greedy, next_token), dim=1)
    assert torch.equal(model.generate(idx, 6, top_k=1), greedy)
    assert torch.equal(model.generate(idx, 6, temperature=0), greedy)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"),
])
def test_generate_rejects_bad_sampling_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_model().generate(tokens(), 1, **kwargs)


def test_config_errors():
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_embd=100, n_head=12)
    with pytest.raises(ValueError, match="choose one of: .*naive"):
        GPTConfig(attn="flash9000")
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.0)
    with pytest.raises(ValueError, match="and on the attention probabilities"):
        GPTConfig.preset("gpt2", attn_dropout=0.1)
    with pytest.raises(ValueError, match="unknown preset"):
        GPTConfig.preset("gpt5")
    with pytest.raises(ValueError, match="block_size=8"):
        tiny_model(block_size=8)(tokens(T=9))


def test_optimizer_groups():
    model = tiny_model()
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, betas=(0.9, 0.95))
    assert opt.defaults["fused"]  # training/step.py skips a non-finite step inside the fused update (found_inf)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    ids = [id(p) for group in opt.param_groups for p in group["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())  # each parameter once, tied weight too
    n_linear = 4 * TINY["n_layer"]
    assert len(decay["params"]) == n_linear + 2  # the Linears + wte (= lm_head) + wpe


# ---------------------------------------------------------------------------------------------
# Sparse attention: a sliding window (backends that take masks) and MoBA (a backend with options of its own)

@pytest.mark.parametrize("overrides, match", [
    (dict(window=-1), r"window must be an int >= 0 \(previous tokens"),
    (dict(window=8.0), "window must be an int"),
    (dict(attn="moba", attn_options={"moba_block": 8}), r"moba_block must be an int >= 16 \(keys per MoBA block"),
    (dict(attn="moba", attn_options={"moba_topk": -1}), "moba_topk must be an int >= 0"),
    (dict(attn="moba", attn_options={"block": 128}), r"'moba' got unknown option\(s\) \['block'\]; its options are "
                                                     "moba_block, moba_topk"),
    (dict(attn_options={"moba_block": 128}), r"'sdpa' got unknown option\(s\) \['moba_block'\]; it takes no options"),
    (dict(attn="moba", attn_options=[("moba_block", 128)]), "attn_options must be a dict"),
    (dict(attn="moba", window=8), "window=8 with attn='moba': that backend takes no masks; pick a backend that does"),
    (dict(attn="mobba"), "unknown attention backend 'mobba'; choose one of: compile, cuda, flex, moba, naive, sdpa, "
                         "triton"),
])
def test_sparse_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**overrides)


def test_attn_options_are_checked_and_filled_with_the_backends_defaults():
    assert GPTConfig(attn="moba").attn_options == {"moba_block": 512, "moba_topk": 3}
    assert GPTConfig(attn="moba", attn_options={"moba_block": 128}).attn_options == {"moba_block": 128,
                                                                                      "moba_topk": 3}
    assert GPTConfig(attn="triton").attn_options == {}
    config = GPTConfig(**TINY, attn="moba", attn_options={"moba_topk": 1})
    assert GPT(config).transformer.h[0].attn.options == {"moba_block": 512, "moba_topk": 1}  # what every layer passes


def test_sparsity_names_what_the_model_computes_beyond_dense_causal_attention():
    assert GPTConfig().sparsity() == {} == GPTConfig(attn="triton").sparsity()  # exact backends: no difference
    assert GPTConfig(attn="triton", window=256).sparsity() == {"window": 256} == GPTConfig(window=256).sparsity()
    moba = GPTConfig(attn="moba", attn_options={"moba_block": 128})
    assert moba.sparsity() == {"attn": "moba", "moba_block": 128, "moba_topk": 3}
    assert moba.sparsity() != GPTConfig(attn="moba").sparsity()  # other options: another function


def test_a_registered_backend_with_options_is_configured_like_moba(monkeypatch):
    def scaled(q, k, v, causal, scale, factor):
        return attention.attention(q, k, v, causal, scale, backend="naive") * factor

    registered_backend(monkeypatch, "test_scaled", scaled, options={"factor": 1.0}, exact=False,
                       keys_per_query=lambda factor: 4)
    config = GPTConfig(**TINY, attn="test_scaled", attn_options={"factor": 0.5})
    assert config.attn_options == {"factor": 0.5}
    assert config.sparsity() == {"attn": "test_scaled", "factor": 0.5}  # not exact: its options are the model's
    with pytest.raises(ValueError, match="that backend takes no masks"):  # no supports_masks
        GPTConfig(**{**TINY, "attn": "test_scaled", "window": 4})
    with pytest.raises(ValueError, match="unknown option"):
        GPTConfig(**TINY, attn="test_scaled", attn_options={"factr": 0.5})
    idx = tokens()
    torch.manual_seed(0)
    half = GPT(config).eval()
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**TINY, attn="test_scaled")).eval()
    assert not torch.allclose(half(idx)[0], plain(idx)[0], atol=1e-3)  # the option reaches every layer
    per_key = 12 * TINY["n_layer"] * TINY["n_embd"]
    assert plain.flops_per_token() - 6 * plain.num_params() == per_key * 4  # its own bound on the keys a query reads


def test_flops_count_the_keys_a_query_reads():
    with torch.device("meta"):
        dense, window = GPT(GPTConfig.preset("124M")), GPT(GPTConfig.preset("124M", window=256))
        moba = GPT(GPTConfig.preset("124M", attn="moba", attn_options={"moba_block": 128}))
        wide_moba = GPT(GPTConfig.preset("124M", attn="moba"))
    per_key = 12 * 12 * 768  # score and value matmuls per key, over all layers
    assert dense.flops_per_token() - window.flops_per_token() == per_key * (1024 - 257)
    assert dense.flops_per_token() - moba.flops_per_token() == per_key * (1024 - 4 * 128)
    assert wide_moba.flops_per_token() == dense.flops_per_token()  # 4 blocks of 512 cover all 1024 keys


def explicit_window_backend(window: int):
    """An attention backend that applies the window as an explicit dense (Tq, Tk) mask."""
    def attend(q, k, v, causal, scale):
        Tq, Tk = q.shape[2], k.shape[2]
        visible = window_mask(Tq, Tk, (window, 0)) & causal_mask(Tq, Tk)
        return naive_attention(q, k, v, causal=False, scale=scale, visible=visible)
    return attend


@pytest.mark.parametrize("backend", ["naive", "sdpa", "triton"])
def test_window_model_matches_an_explicit_window_mask(backend, monkeypatch):
    registered_backend(monkeypatch, "window4", explicit_window_backend(4))
    idx = tokens()  # T=12: every query past the 5th loses keys to the window
    logits = tiny_model(attn=backend, window=4)(idx)[0]
    torch.testing.assert_close(logits, tiny_model(attn="window4")(idx)[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits, tiny_model(attn=backend)(idx)[0], atol=1e-3)  # the window changed something


def test_window_model_generates_the_same_with_and_without_the_cache(monkeypatch):
    model = tiny_model(attn="naive", window=4)
    calls = []

    def recording(q, k, v, **kwargs):
        calls.append((q.shape[2], k.shape[2], kwargs["window"]))
        return attention.attention(q, k, v, **kwargs)

    monkeypatch.setattr(model_module, "attention", recording)
    idx = tokens(T=5)
    cached = model.generate(idx, 14, temperature=0)  # 19 tokens: past block_size=16, the context gets cropped
    assert torch.equal(cached, model.generate(idx, 14, temperature=0, use_cache=False))
    # after the prompt's prefill, one query at a time against the newest window + 1 cached keys
    layers = TINY["n_layer"]
    assert calls[:layers] == [(5, 5, (4, 0))] * layers
    assert calls[layers:2 * layers] == [(1, 5, (4, 0))] * layers
    assert all(Tk <= 5 for Tq, Tk, _ in calls if Tq == 1)
    with pytest.raises(ValueError, match="and a dense model without window"):
        model.generate(idx, 1, cuda_graph=True)


def moba_reference(q, k, v, causal, scale, moba_block, moba_topk):
    """A backend running MoBA's dense reference: the same block selection as a (T, T) mask over naive attention."""
    return moba_attention(q, k, v, moba_block, moba_topk, scale, backend="naive")


def test_moba_model_matches_the_dense_reference_of_its_selection(monkeypatch):
    # T=96 in blocks of 32 (the interpreter's tile; a GPU needs multiples of 128): the last block's
    # queries pick 1 of 2 earlier blocks, so the selection is really exercised
    moba = attention.get_backend("moba")
    registered_backend(monkeypatch, "moba_naive", moba_reference, options=moba.options, exact=False, kv_cache=False)
    shape = dict(block_size=96, n_layer=1, n_head=2, n_embd=32)  # head dim 16
    idx, targets = tokens(T=96), tokens(T=96, seed=2)
    results = {}
    for attn, options in (("moba", {"moba_block": 32, "moba_topk": 1}), ("moba_naive", {"moba_block": 32,
                                                                                          "moba_topk": 1}),
                          ("naive", {})):
        model = tiny_model(**shape, attn=attn, attn_options=options)
        logits, loss = model(idx, targets)
        loss.backward()
        results[attn] = logits.detach(), {n: p.grad for n, p in model.named_parameters()}
    (logits, grads), (ref_logits, ref_grads) = results["moba"], results["moba_naive"]
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert not torch.allclose(logits, results["naive"][0], atol=1e-3)  # MoBA skipped blocks dense attention reads


def test_moba_model_generates_without_a_cache():
    model = tiny_model(block_size=8, n_layer=1, n_head=2, n_embd=32, attn="moba", attn_options={"moba_block": 32})
    idx = tokens(B=1, T=3)
    out = model.generate(idx, 2, temperature=0)  # use_cache=True is overridden: MoBA has no one-query form
    assert torch.equal(out, model.generate(idx, 2, temperature=0, use_cache=False))
    with pytest.raises(ValueError, match="attn='moba' attends whole sequences only .* runs without KV caches"):
        model(idx, kv_caches=[KVCache(8)])


def test_from_pretrained_weights_with_a_window(tmp_path):
    hf = random_hf_gpt2()
    hf.save_pretrained(tmp_path)
    model = GPT.from_pretrained(str(tmp_path / "model.safetensors"), attn="naive", window=4)
    assert model.config.window == 4
    idx = tokens()
    torch.testing.assert_close(model(idx)[0][:, :5], hf(idx).logits[:, :5], rtol=1e-5, atol=1e-5)  # inside the window
    assert not torch.allclose(model(idx)[0][:, 5:], hf(idx).logits[:, 5:], atol=1e-3)
    moba = GPT.from_pretrained(str(tmp_path / "model.safetensors"), attn="moba", attn_options={"moba_block": 32})
    assert moba.config.sparsity() == {"attn": "moba", "moba_block": 32, "moba_topk": 3}


@pytest.mark.parametrize("backend,window", [("naive", 0), ("triton", 0), ("triton", 3), ("sdpa", 5)])
def test_doc_mask_keeps_each_document_to_itself(backend, window):
    # a document starts at each EOT: changing the tokens of one document changes no other document's logits, and
    # the logits are those of the naive backend with the same masks
    torch.manual_seed(0)
    model = tiny_model(attn=backend, doc_mask=True, window=window).eval()
    eot = model.config.doc_token
    idx = random_tokens(2, 16, 1000, seed=3)
    idx[0, [0, 6, 7]] = eot  # row 0: documents at 0..5, 6, 7..15; row 1: one document
    idx[1, 0] = eot
    logits = model(idx)[0]
    changed = idx.clone()
    changed[0, 1:6] = random_tokens(1, 5, 1000, seed=4)[0]  # the first document of row 0
    changed_logits = model(changed)[0]
    assert not torch.allclose(changed_logits[0, :6], logits[0, :6])
    torch.testing.assert_close(changed_logits[0, 6:], logits[0, 6:], atol=1e-5, rtol=0)
    torch.testing.assert_close(changed_logits[1], logits[1], atol=1e-5, rtol=0)
    naive = tiny_model(attn="naive", doc_mask=True, window=window).eval()
    torch.testing.assert_close(naive(idx)[0], logits, atol=1e-4, rtol=0)
    # without doc_mask the first document's tokens do reach the later ones
    assert not torch.allclose(tiny_model(attn=backend, window=window).eval()(changed)[0][0, 6:],
                              tiny_model(attn=backend, window=window).eval()(idx)[0][0, 6:])


def test_doc_mask_generate_runs_without_cache_and_matches_the_full_forward():
    torch.manual_seed(0)
    model = tiny_model(attn="naive", doc_mask=True).eval()
    idx = random_tokens(1, 6, 1000, seed=5)
    idx[0, 3] = model.config.doc_token
    out = model.generate(idx, 4, temperature=0)
    for t in range(6, 10):  # each greedy token is the argmax of the full forward over what came before
        assert out[0, t] == model(out[:, :t])[0][0, -1].argmax()
    with pytest.raises(ValueError, match="without KV caches"):
        model(idx, kv_caches=[KVCache(16) for _ in range(model.config.n_layer)])


def test_doc_mask_needs_a_backend_with_masks():
    with pytest.raises(ValueError, match="takes no masks"):
        GPTConfig(attn="moba", doc_mask=True)
