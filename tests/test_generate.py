"""GPT.generate() with the KV cache (generation.py): the same tokens and logits as re-running the whole context."""
import json

import pytest
import torch
from helpers import random_tokens, registered_backend

import model as model_module
from attention import decode_attention
from attention.reference.naive import naive_attention
from benchmarks import generate as bench
from generation import DecodeStep, KVCache
from model import GPT, GPTConfig

# head dim 16: the smallest tl.dot takes; a small vocabulary keeps the interpreter quick
TINY = dict(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32)
BACKENDS = ["naive", "sdpa", "triton"]


def with_large_weights(model: GPT) -> GPT:
    """GPT-2's init makes the logits nearly uniform, and in a tiny model the next token mostly
    repeats the last one. Larger weights give varied tokens whose argmax wins by margins far
    above float rounding, so cached and uncached paths must agree exactly."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 2 / model.config.n_embd**0.5)
    return model


def tiny_model(attn="naive", **overrides):
    torch.manual_seed(0)
    return with_large_weights(GPT(GPTConfig(**{**TINY, **overrides}, attn=attn)).eval())


def prompt(B=2, T=3):
    return random_tokens(B, T, TINY["vocab_size"], seed=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_same_with_and_without_cache_across_the_window_slide(backend):
    # block_size 8, prompt 3, 8 new tokens: 5 cached steps, then the window is full and slides
    model = tiny_model(backend, block_size=8)
    cached = model.generate(prompt(), 8, temperature=0)
    assert cached.shape == (2, 11) and len(cached[0, 3:].unique()) > 3  # not one token repeated
    assert torch.equal(cached, model.generate(prompt(), 8, temperature=0, use_cache=False))
    assert torch.equal(cached, model.generate(prompt(), 8, top_k=1))


def test_cache_runs_one_query_per_step_until_the_window_is_full(monkeypatch):
    # the equality tests above would also pass if generate() ignored the cache: check what attention saw
    seen = []

    def spy(q, k, v, causal, scale):
        seen.append(("attention", q.size(2), k.size(2)))
        return naive_attention(q, k, v, causal, scale)

    def decode_spy(q, k_cache, v_cache, cache_len, backend):
        seen.append(("decode", q.size(2), k_cache.size(2), cache_len.tolist()))
        return decode_attention(q, k_cache, v_cache, cache_len, backend="naive")

    registered_backend(monkeypatch, "spy", spy)
    monkeypatch.setattr(model_module, "decode_attention", decode_spy)
    tiny_model("spy", block_size=8).generate(prompt(), 8, temperature=0)
    per_step = seen[::TINY["n_layer"]]
    assert seen == [call for call in per_step for _ in range(TINY["n_layer"])]
    # prefill of 3; then one new token against the whole 8-position buffer, 4..8 of them valid (the
    # length a device tensor); then the window is full: re-prefills of the last 8 tokens
    assert per_step == [("attention", 3, 3), *[("decode", 1, 8, [n]) for n in range(4, 9)],
                        ("attention", 8, 8), ("attention", 8, 8)]


def test_sampling_with_a_fixed_seed_is_the_same_with_and_without_cache():
    model = tiny_model(block_size=8)
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(123)
        outs.append(model.generate(prompt(), 8, temperature=1.0, top_k=20, use_cache=use_cache))
    assert torch.equal(*outs)
    assert not torch.equal(outs[0], model.generate(prompt(), 8, temperature=0))  # it did sample


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_logits_match_the_full_forward(backend):
    # prefill 5 tokens, then a block of 3 (Tq > 1 against the cache), then single tokens
    model = tiny_model(backend)
    idx = random_tokens(2, 11, TINY["vocab_size"], seed=2)
    full, _ = model(idx)  # (B, T, vocab)
    caches = [KVCache(max_len=11) for _ in range(TINY["n_layer"])]
    with torch.no_grad():
        for start, end in [(0, 5), (5, 8), (8, 9), (9, 10), (10, 11)]:
            logits, _ = model(idx[:, start:end], kv_caches=caches)
            torch.testing.assert_close(logits, full[:, start:end], rtol=1e-5, atol=1e-5)
    assert [c.length for c in caches] == [11, 11]


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_decode_step_logits_match_the_full_forward(backend):
    # prefill 4 tokens, then the static step of generate() for each of the next 6
    model = tiny_model(backend)
    idx = random_tokens(2, 10, TINY["vocab_size"], seed=3)
    full, _ = model(idx)  # (B, T, vocab)
    caches = [KVCache(max_len=12) for _ in range(TINY["n_layer"])]  # 2 positions never written
    with torch.no_grad():
        model(idx[:, :4], kv_caches=caches)
        step = DecodeStep(model, caches, idx[:, 4:5], cuda_graph=False)
        buffer = caches[0].k.data_ptr()
        for t in range(4, 10):
            torch.testing.assert_close(step(idx[:, t:t + 1]), full[:, t], rtol=1e-5, atol=1e-5)
    assert [c.length for c in caches] == [10, 10] and step.pos.tolist() == [10] and step.cache_len.tolist() == [11]
    assert caches[0].k.data_ptr() == buffer  # written in place
    caches[0].clear()
    assert caches[0].step_pos is None and caches[0].length == 0  # back to extend() for the next prefill


def test_cuda_graph_needs_the_cache_and_a_gpu():
    model = tiny_model()
    with pytest.raises(ValueError, match="cuda_graph=True .* needs use_cache=True and idx on a CUDA device"):
        model.generate(prompt(), 2, cuda_graph=True)
    with pytest.raises(ValueError, match="use_cache=False"):
        model.generate(prompt(), 2, use_cache=False, cuda_graph=True)
    # cuda_graph=False is the default on the CPU: the same tokens either way
    assert torch.equal(model.generate(prompt(), 4, temperature=0, cuda_graph=False),
                       model.generate(prompt(), 4, temperature=0))


def test_cache_writes_in_place_into_one_buffer():
    cache = KVCache(max_len=6)
    k1, v1 = torch.randn(2, 1, 2, 3, 16).unbind(0)  # (B=1, nh=2, T=3, hs=16)
    k2, v2 = torch.randn(2, 1, 2, 1, 16).unbind(0)
    cache.extend(k1, v1)
    buffer = cache.k.data_ptr()
    k, v = cache.extend(k2, v2)
    assert cache.k.shape == (1, 2, 6, 16) and cache.k.data_ptr() == k.data_ptr() == buffer
    assert torch.equal(k, torch.cat((k1, k2), dim=2)) and torch.equal(v, torch.cat((v1, v2), dim=2))
    cache.clear()
    k, _ = cache.extend(k2, v2)
    assert cache.length == 1 and torch.equal(k, k2) and cache.k.data_ptr() == buffer


def test_cache_overflow_and_bad_cache_lists_raise():
    model = tiny_model(block_size=8)
    caches = [KVCache(max_len=8) for _ in range(TINY["n_layer"])]
    with torch.no_grad():
        model(prompt(T=6), kv_caches=caches)
        with pytest.raises(ValueError, match="6 cached \\+ 3 new tokens exceeds block_size=8"):
            model(prompt(T=3), kv_caches=caches)
        with pytest.raises(ValueError, match="2 KV caches for 3 layers"):
            tiny_model(n_layer=3)(prompt(), kv_caches=caches)
    with pytest.raises(ValueError, match="overflow"):
        KVCache(max_len=2).extend(torch.zeros(1, 1, 3, 16), torch.zeros(1, 1, 3, 16))


def test_cache_takes_the_dtype_of_the_keys_under_autocast():
    model = tiny_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.generate(prompt(), 4, temperature=0)
    assert out.shape == (2, 7)


def test_benchmark_runs_a_toy_model_and_writes_json_and_table(tmp_path):
    results = bench.main(["--device", "cpu", "--model", "toy", "--backends", "naive", "--prompt_len", "4",
                          "--new_tokens", "3", "--batch_sizes", "1,2", "--warmup", "0", "--repeats", "1",
                          "--out_dir", str(tmp_path)])
    assert json.loads((tmp_path / "results.json").read_text()) == results
    rows = results["rows"]
    # no CUDA graph on the CPU: two modes per batch size
    assert [(r["B"], r["mode"], r["use_cache"]) for r in rows] == [
        (1, "no cache", False), (1, "cache", True), (2, "no cache", False), (2, "cache", True)]
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(r["B"] * 3 / r["median_s"]) and len(r["runs_s"]) == 1
    table = [line for line in (tmp_path / "results.md").read_text().splitlines() if line.startswith("| naive")]
    assert len(table) == 2 and table[0].startswith("| naive | 1 | ") and table[1].startswith("| naive | 2 | ")
    cells = table[1].strip("| ").split(" | ")
    assert cells[2:5] == [bench.fmt(rows[2]["tokens_per_s"]), bench.fmt(rows[3]["tokens_per_s"]), "-"]
    assert cells[5:7] == [bench.fmt(rows[3]["tokens_per_s"] / rows[2]["tokens_per_s"]) + "x", "-"]
    assert cells[7] == ("yes" if rows[3]["same_tokens"] else "no") + " / -"


def test_benchmark_measures_the_graph_mode_on_cuda_only():
    assert bench.modes_for(torch.device("cpu")) == ["no cache", "cache"]
    assert bench.modes_for(torch.device("cuda")) == ["no cache", "cache", "cache+graph"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_greedy_tokens_same_with_and_without_cache_and_graph(backend):
    # GPT-2's head size and width, fp32 so that rounding cannot flip the argmax
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=128, vocab_size=64, n_layer=2, n_head=12, n_embd=768, attn=backend))
    model = with_large_weights(model.cuda().eval())
    idx = random_tokens(2, 64, 64, seed=1, device="cuda")
    uncached = model.generate(idx, 96, temperature=0, use_cache=False)  # past block_size: the window slides
    assert len(uncached[0, 64:].unique()) > 3
    assert torch.equal(model.generate(idx, 96, temperature=0, cuda_graph=False), uncached)
    assert torch.equal(model.generate(idx, 96, temperature=0), uncached)  # cuda_graph on by default on CUDA
    torch.manual_seed(5)
    sampled = model.generate(idx, 40, temperature=1.0, top_k=10, use_cache=False)
    torch.manual_seed(5)
    assert torch.equal(model.generate(idx, 40, temperature=1.0, top_k=10, cuda_graph=True), sampled)


@pytest.mark.gpu
def test_gpu_cuda_graph_captures_the_decode_step_once_and_replays_it_per_token(monkeypatch):
    calls = []
    graph_class = torch.cuda.CUDAGraph
    capture_begin, replay = graph_class.capture_begin, graph_class.replay
    monkeypatch.setattr(graph_class, "capture_begin",
                        lambda graph, *args, **kwargs: calls.append("capture") or capture_begin(graph, *args, **kwargs))
    monkeypatch.setattr(graph_class, "replay", lambda graph: calls.append("replay") or replay(graph))
    model = tiny_model("triton").cuda()
    out = model.generate(prompt().cuda(), 12, temperature=0)  # block_size 16: a prefill, then 11 decode steps
    assert calls == ["capture"] + ["replay"] * 11
    assert torch.equal(out, model.generate(prompt().cuda(), 12, temperature=0, use_cache=False))
