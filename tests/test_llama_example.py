"""examples/llama.py and examples/train_llama.py on the CPU: a tiny model with head size 16."""
import json
import math
from dataclasses import replace

import pytest
import torch
from helpers import TRAIN_KEYS, random_tokens, token_shards

from benchmarks.compare_report import write_report
from examples import train_llama
from examples.llama import Llama, LlamaConfig, apply_rope, rope_angles

VOCAB = 64
# 4 query heads share 2 kv heads; 64 / 4 = head size 16, the smallest the Triton kernel takes
TINY = LlamaConfig(block_size=16, vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)


def test_shapes_and_initial_loss():
    torch.manual_seed(0)
    model = Llama(TINY)
    idx, targets = random_tokens(2, 16, VOCAB, seed=1), random_tokens(2, 16, VOCAB, seed=2)
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 16, VOCAB)
    assert abs(loss.item() - math.log(VOCAB)) < 0.1  # small init: close to a uniform guess
    logits_short, no_loss = model(idx[:, :5])
    assert no_loss is None
    torch.testing.assert_close(logits_short, logits[:, :5])  # causal: later tokens change nothing before them
    # grouped-query attention: k and v project to n_kv_head heads only
    assert model.layers[0].attn.wk.weight.shape == (2 * 16, 64)


def test_default_size_and_tied_embedding():
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = Llama(LlamaConfig())
    assert model.output.weight is model.tok_embeddings.weight
    assert 45e6 < model.num_params() < 50e6
    assert model.config.ffn_dim == 1408  # 8/3 * 512 rounded up to a multiple of 64


def test_optimizer_decays_matrices_only():
    model = Llama(TINY)
    decay, no_decay = model.configure_optimizer(0.1, 1e-3, (0.9, 0.95)).param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 2 * TINY.n_layer + 1  # the RMSNorm gains
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def rotated(vector: torch.Tensor, n_positions: int) -> torch.Tensor:
    """The same head vector (hs,) at every position 0..n-1, rotated by RoPE: (n, hs)."""
    cos, sin = rope_angles(vector.numel(), n_positions, theta=10000.0)
    x = vector.expand(1, n_positions, 1, -1)  # (B=1, T, nh=1, hs)
    return apply_rope(x, cos, sin)[0, :, 0]


def test_rope_score_depends_on_relative_position_only():
    torch.manual_seed(0)
    q, k = rotated(torch.randn(16), 12), rotated(torch.randn(16), 12)
    scores = q @ k.T  # scores[m, n] = q at position m . k at position n
    torch.testing.assert_close(scores[1:, 1:], scores[:-1, :-1])  # shifting both positions changes nothing
    assert (scores[0, 0] - scores[0, 5]).abs() > 1e-2  # but the distance matters: RoPE does rotate


def test_rope_keeps_norms_and_dtype():
    x = torch.randn(2, 10, 3, 16, dtype=torch.float16)
    cos, sin = rope_angles(16, 10, theta=10000.0)
    y = apply_rope(x, cos, sin)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float().norm(dim=-1), x.float().norm(dim=-1), atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0: angle 0, no rotation


@pytest.mark.parametrize("overrides, match", [
    (dict(n_head=3), "not divisible by n_head"),
    (dict(n_kv_head=3), "not a multiple of n_kv_head"),
    (dict(n_embd=36, n_head=4, n_kv_head=1), "is odd"),
    (dict(attn="flash9"), "unknown attention backend"),
    (dict(n_layer=0), "positive int"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        replace(TINY, **overrides)


def test_too_long_input_is_an_error():
    with pytest.raises(ValueError, match="exceeds block_size=16"):
        Llama(TINY)(torch.zeros(1, 17, dtype=torch.long))


def logits_and_grads(backend: str, state: dict, idx, targets):
    model = Llama(replace(TINY, attn=backend))
    model.load_state_dict(state)
    logits, loss = model(idx, targets)
    loss.backward()
    return logits, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_backends_agree_with_sdpa(backend):
    torch.manual_seed(0)
    state = Llama(TINY).state_dict()
    idx, targets = random_tokens(2, 16, VOCAB, seed=1), random_tokens(2, 16, VOCAB, seed=2)
    ref_logits, ref_grads = logits_and_grads("sdpa", state, idx, targets)
    logits, grads = logits_and_grads(backend, state, idx, targets)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-4)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_training_lowers_loss_and_writes_metrics(tmp_path):
    # a repeating 40-token phrase: learnable within a few steps
    token_shards(tmp_path, VOCAB, {"train": 4_000}, phrase=40)
    out_dir = tmp_path / "llama" / "sdpa"
    shape = [f"--{k}={getattr(TINY, k)}" for k in ("block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")]
    train_llama.main([*shape, "--attn=sdpa", f"--data_dir={tmp_path}", f"--out_dir={out_dir}", "--device=cpu",
                      "--max_steps=12", "--batch_size=4", "--warmup_steps=2", "--learning_rate=1e-2", "--min_lr=1e-3"])

    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(12))
    assert all(r.keys() == TRAIN_KEYS and r["attn"] == "sdpa" for r in records)
    assert [r["warmup"] for r in records[:4]] == [True, True, True, False]
    assert records[-1]["train_loss"] < records[0]["train_loss"] - 1.0
    # the format benchmarks/compare_report.py reads: one folder per backend
    summary = write_report(tmp_path / "llama", reference="sdpa", skip_steps=0)
    row = summary["backends"]["sdpa"]
    assert row["status"] == "ok" and row["last_step"] == 11 and row["timed_steps"] == 9
    assert summary["warnings"] == [] and "--n_kv_head=2" in summary["train_args"]


def test_bad_flags_exit_with_a_message(tmp_path):
    with pytest.raises(SystemExit, match="not a multiple of n_kv_head"):
        train_llama.main(["--n_kv_head=3", f"--out_dir={tmp_path}"])
    with pytest.raises(SystemExit, match="prepare the data first"):
        train_llama.main([f"--data_dir={tmp_path / 'none'}", f"--out_dir={tmp_path}", "--device=cpu", "--max_steps=1",
                          "--warmup_steps=0", "--block_size=8", "--n_layer=1", "--n_embd=32", "--n_head=2",
                          "--n_kv_head=1", "--vocab_size=64"])
