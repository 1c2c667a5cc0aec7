"""training/warm_kernels.py: the helper that compiles a run's Triton kernels into Triton's cache at start-up. On the
CPU: when it starts and what it runs; on the GPU (marked gpu): that the run then finds every attention kernel in the
cache."""
import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

import model
from model import GPTConfig
from training import warm_kernels

CONFIG = GPTConfig(block_size=32, vocab_size=64, n_layer=1, n_head=2, n_embd=32, attn="triton")


@pytest.mark.parametrize("change, starts", [
    ({}, True),
    ({"attn": "sdpa"}, False),  # nothing of ours to compile
    ({"doc_mask": True}, False),  # document masks come with each batch
    ({"device": "cpu"}, False),
    ({"local_rank": 1}, False),  # one helper per machine: the ranks share the cache
    ({"NANOFLASH_WARM": "0"}, False),
])
def test_starts_for_our_kernels_on_a_gpu_once_per_machine(monkeypatch, change, starts):
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda args, **kwargs: started.append((args, kwargs)) or "helper")
    monkeypatch.setattr(warm_kernels.atexit, "register", lambda *args: None)
    if "NANOFLASH_WARM" in change:
        monkeypatch.setenv("NANOFLASH_WARM", change["NANOFLASH_WARM"])
    config = GPTConfig(**{**asdict(CONFIG), **{k: v for k, v in change.items() if k in ("attn", "doc_mask")}})
    helper = warm_kernels.start(config, 4, torch.bfloat16, torch.device(change.get("device", "cuda:0")),
                                change.get("local_rank", 0))
    assert (helper == "helper") is starts and len(started) == int(starts)
    if starts:
        args, kwargs = started[0]
        spec = json.loads(args[-1])
        assert spec == dict(config=asdict(config), batch_size=4, dtype="bfloat16", device="cuda:0")
        assert kwargs["env"]["NANOFLASH_NATIVE"] == "0"  # no C++ launcher build in the helper


def test_runs_the_evaluation_forward_then_the_training_forward_and_backward(monkeypatch):
    # the model's own attention call, under no_grad first (evaluation), then with gradients, and a backward through it
    calls, real = [], model.attention_qkvpacked

    def recorded(qkv, **kwargs):
        calls.append((torch.is_grad_enabled(), tuple(qkv.shape), kwargs["backend"]))
        return real(qkv, **kwargs)
    monkeypatch.setattr(model, "attention_qkvpacked", recorded)
    spec = dict(config=asdict(CONFIG), batch_size=2, dtype="float32", device="cpu")
    warm_kernels.run(spec)
    assert calls == [(False, (2, 32, 3, 2, 16), "triton"), (True, (2, 32, 3, 2, 16), "triton")]


@pytest.mark.gpu
def test_the_run_finds_its_attention_kernels_in_the_cache(tmp_path):
    # the helper fills a fresh Triton cache; a compiled model of the same settings then compiles none of ours
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "TRITON_INTERPRET": "0"}
    config = GPTConfig(block_size=1024, vocab_size=50304, n_layer=1, n_head=12, n_embd=768, attn="triton")
    spec = dict(config=asdict(config), batch_size=4, dtype="bfloat16", device="cuda:0")
    subprocess.run([sys.executable, "-m", "training.warm_kernels", json.dumps(spec)], cwd=warm_kernels.ROOT, env=env,
                   check=True, timeout=300)

    def ours():
        return {p.relative_to(tmp_path) for p in (tmp_path / "triton").rglob("attn_*")}  # a compile's own folder
    warmed = ours()
    assert warmed  # the helper compiled our kernels into the cache
    check = """
import torch
from model import GPT, GPTConfig
m = torch.compile(GPT(GPTConfig(block_size=1024, vocab_size=50304, n_layer=1, n_head=12, n_embd=768,
                                attn="triton")).cuda())
x = torch.randint(0, 50304, (4, 1024), device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    m.eval()
    with torch.no_grad():
        m(x, x)
    m.train()
    m(x, x)[1].backward()
torch.cuda.synchronize()
"""
    subprocess.run([sys.executable, "-c", check], cwd=warm_kernels.ROOT, env=env, check=True, timeout=300)
    assert ours() == warmed  # every attention kernel the run launched was found, none compiled anew
