"""train.py on the CPU with a tiny model: learning, exact resume, DDP, checkpoints, signals, bad input, non-finite
steps, the wrong machine.

Most runs call train() or main() in-process (a few hundred ms each); the CLI, torchrun, SIGTERM and missing-interpreter
tests start real processes because the process boundary (or the environment a process starts with) is what they test.
test_faults.py kills runs with SIGKILL and damages their checkpoints and data; test_checkpoint.py tests the checkpoint
files themselves.
"""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import (ROOT, TRAIN_PY_KEYS, cli_flags, cpu_env, nan_loss_forward, read_metrics, run_cli, run_main,
                     token_shards)

import train
from model import GPT, GPTConfig
from training.checkpoint import CheckpointError, Checkpoints, read_checkpoint
from training.config import ConfigError, TrainConfig, parse_args
from training.logger import RunLogger, peak_flops
from training.preflight import set_tf32

VOCAB = 64
# tiny: 2 layers, 2 heads of 16 channels, 16-token context, 4 sequences per batch
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=VOCAB, batch_size=4, device="cpu",
            wandb=False, sample_interval=0, eval_interval=0, eval_iters=2, log_interval=1,
            checkpoint_interval=0, warmup_steps=2, learning_rate=1e-2, min_lr=1e-3, seed=0)
VAL_KEYS = {"step", "val_loss", "attn"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Shards in the data package's format: a repeating 40-token phrase with 10% random tokens,
    learnable enough for the loss to fall within a few steps."""
    folder = tmp_path_factory.mktemp("tokens")
    return str(token_shards(folder, VOCAB, {"train": 20_000, "val": 4_000}, phrase=40, noise=0.1))


def tiny_config(out_dir, data_dir, **overrides) -> TrainConfig:
    return TrainConfig(**{**TINY, "out_dir": str(out_dir), "data_dir": data_dir, **overrides})


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("step_ms", "tokens_per_s", "warmup")} for r in records]


def test_resumed_metrics_keep_one_curve(tmp_path):
    # what a run killed after its step-3 checkpoint leaves: records up to step 5 and a half-written line
    lines = [{"step": s, "train_loss": 1.0 / (s + 1)} for s in range(6)] + [{"step": 3, "val_loss": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 6, "tr')
    logger = RunLogger(TrainConfig(out_dir=str(tmp_path), resume=True, wandb=False), 3, None)
    logger.log_val(3, 0.25, "sdpa")
    logger.close()
    kept = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert kept == lines[:3] + [{"step": 3, "val_loss": 0.25, "attn": "sdpa"}]


def test_wandb_gets_the_skip_count_not_the_non_finite_values(tmp_path):
    logger = RunLogger(TrainConfig(out_dir=str(tmp_path), wandb=False), 0, None)
    logged = []
    logger.wandb_run = SimpleNamespace(log=lambda data, step: logged.append((step, data)), finish=lambda: None)
    base = {"lr": 1e-3, "step_ms": 10.0, "tokens_per_s": 100.0, "mfu": None, "peak_mem_gb": None, "attn": "sdpa",
            "warmup": False}
    logger.log_train({**base, "step": 7, "train_loss": 2.5, "grad_norm": 0.5, "skipped": False, "skipped_steps": 0})
    # a skipped step as train.py records it: its non-finite loss and norm as null
    logger.log_train({**base, "step": 8, "train_loss": None, "grad_norm": None, "skipped": True, "skipped_steps": 1})
    logger.close()
    assert logged[0] == (7, {"train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.5, "train/skipped_steps": 0,
                             "perf/step_ms": 10.0, "perf/tokens_per_s": 100.0})
    assert logged[1][0] == 8 and logged[1][1]["train/skipped_steps"] == 1
    assert "train/loss" not in logged[1][1] and "train/grad_norm" not in logged[1][1]
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert records[1]["skipped"] is True and records[1]["train_loss"] is None


@pytest.mark.parametrize("tf32, precision", [(True, "high"), (False, "highest")])
def test_tf32_sets_cudas_float32_matmul_precision(tf32, precision):
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        set_tf32(parse_args([f"--tf32={tf32}"]), torch.device("cuda"))
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == (precision, tf32)
        set_tf32(parse_args([f"--tf32={not tf32}"]), torch.device("cpu"))  # no CUDA: nothing changes
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == (precision, tf32)
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_a_few_steps_lower_the_loss(tmp_path, data_dir):
    train.train(tiny_config(tmp_path, data_dir, max_steps=30, eval_interval=15))
    records, vals = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(30))
    first, last = records[0]["train_loss"], np.mean([r["train_loss"] for r in records[-5:]])
    assert first == pytest.approx(np.log(VOCAB), abs=0.3)  # small init: near-uniform predictions
    assert last < first - 1.0
    assert [v["step"] for v in vals] == [0, 15, 30] and vals[-1]["val_loss"] < vals[0]["val_loss"] - 1.0


def test_metrics_jsonl_has_the_documented_keys(tmp_path, data_dir):
    train.train(tiny_config(tmp_path, data_dir, max_steps=5, eval_interval=2, log_interval=2, attn="naive"))
    records, vals = read_metrics(tmp_path)
    assert all(set(r) == TRAIN_PY_KEYS for r in records) and all(set(v) == VAL_KEYS for v in vals)
    assert [r["step"] for r in records] == [0, 2, 4]  # every log_interval steps, and the last
    assert [v["step"] for v in vals] == [0, 2, 4, 5]  # every eval_interval steps, and after the last
    assert [r["warmup"] for r in records] == [True, True, False]
    for r in records:
        assert r["attn"] == "naive" and r["mfu"] is None and r["peak_mem_gb"] is None  # CPU: no peak known
        assert r["step_ms"] > 0 and r["tokens_per_s"] == pytest.approx(4 * 16 / (r["step_ms"] / 1000))
        assert r["grad_norm"] > 0 and r["lr"] == train.lr_at(r["step"], tiny_config(tmp_path, data_dir, max_steps=5))


def test_each_step_time_on_the_cpu_is_its_own(tmp_path, data_dir):
    # a step read right after the one before it (before an evaluation, and the last) still gets its own time: on the
    # CPU the launch's wall time, not the moment between two reads
    train.train(tiny_config(tmp_path, data_dir, max_steps=9, eval_interval=4, log_interval=1))
    records, _ = read_metrics(tmp_path)
    times = {r["step"]: r["step_ms"] for r in records}
    typical = np.median(list(times.values()))
    assert all(ms > typical / 5 for ms in times.values()), times  # steps 3, 7 and 8 among them


def test_resume_gives_bit_identical_losses(tmp_path, data_dir):
    # dropout and gradient accumulation on, so the RNG state and the data position both matter
    settings = dict(dropout=0.1, total_batch_size=2 * 4 * 16, eval_interval=3, lr_decay_steps=8)
    train.train(tiny_config(tmp_path / "straight", data_dir, max_steps=8, **settings))
    train.train(tiny_config(tmp_path / "split", data_dir, max_steps=4, **settings))
    assert read_checkpoint(tmp_path / "split" / "ckpt.pt")["step"] == 4
    train.train(tiny_config(tmp_path / "split", data_dir, max_steps=8, resume=True, **settings))

    straight, split = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert without_timing(split[0]) == without_timing(straight[0])  # train records: exact float equality
    assert split[1] == straight[1] and [v["step"] for v in split[1]] == [0, 3, 6, 8]
    weights = [read_checkpoint(tmp_path / run / "ckpt.pt")["model"] for run in ("straight", "split")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_gradient_accumulation_matches_one_big_batch(tmp_path, data_dir):
    train.train(tiny_config(tmp_path / "big", data_dir, max_steps=4))
    train.train(tiny_config(tmp_path / "accum", data_dir, max_steps=4, batch_size=2, total_batch_size=4 * 16))
    big, accum = read_metrics(tmp_path / "big")[0], read_metrics(tmp_path / "accum")[0]
    np.testing.assert_allclose([r["train_loss"] for r in accum], [r["train_loss"] for r in big], rtol=1e-5)


def test_init_from_a_weights_file_starts_from_those_weights(tmp_path, data_dir):
    torch.manual_seed(1)
    source = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=VOCAB))
    # saved in Hugging Face's GPT-2 layout, whose Conv1D layers store their weights transposed
    conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
    torch.save({k: v.t() if k.endswith(conv1d) else v for k, v in source.state_dict().items()}, tmp_path / "w.pt")
    (tmp_path / "config.json").write_text('{"n_head": 2}')
    tokens = torch.from_numpy(np.load(Path(data_dir) / "train_000000.npy")[:4 * 16 + 1].astype(np.int64))
    _, first_loss = source(tokens[:-1].view(4, 16), tokens[1:].view(4, 16))

    train.train(tiny_config(tmp_path / "run", data_dir, init_from=str(tmp_path / "w.pt"), max_steps=2))
    assert read_metrics(tmp_path / "run")[0][0]["train_loss"] == pytest.approx(first_loss.item(), rel=1e-6)
    assert read_checkpoint(tmp_path / "run" / "ckpt.pt")["model_config"]["n_layer"] == 1  # not TINY's 2


def test_window_run_records_its_window_and_resumes_only_with_it(tmp_path, data_dir, capsys):
    train.train(tiny_config(tmp_path / "window", data_dir, max_steps=2, window=4))
    assert "attn=sdpa, window=4, cpu" in capsys.readouterr().out
    checkpoint = read_checkpoint(tmp_path / "window" / "ckpt.pt")
    assert checkpoint["model_config"]["window"] == 4 and checkpoint["train_config"]["window"] == 4
    train.train(tiny_config(tmp_path / "dense", data_dir, max_steps=2))
    losses = {run: [r["train_loss"] for r in read_metrics(tmp_path / run)[0]] for run in ("window", "dense")}
    assert losses["window"] != losses["dense"]  # T=16 > 4 + 1: the window hides keys from most queries

    with pytest.raises(ConfigError, match="resume with the settings that trained it: --attn=sdpa --window=4"):
        train.train(tiny_config(tmp_path / "window", data_dir, max_steps=3, resume=True))
    train.train(tiny_config(tmp_path / "window", data_dir, max_steps=3, resume=True, window=4, attn="naive"))
    assert [r["step"] for r in read_metrics(tmp_path / "window")[0]] == [0, 1, 2]


def test_moba_run_trains_through_the_triton_kernel_and_resumes_only_as_moba(tmp_path, data_dir):
    # T=64 in MoBA blocks of 32 (the interpreter's tile; a GPU needs multiples of 128); topk=0 leaves
    # each query its own block only, so the model differs from dense causal attention
    settings = dict(max_steps=2, block_size=64, batch_size=2, n_layer=1, moba_block=32, moba_topk=0)
    train.train(tiny_config(tmp_path / "moba", data_dir, attn="moba", **settings))
    train.train(tiny_config(tmp_path / "dense", data_dir, **settings))
    moba, dense = ([r["train_loss"] for r in read_metrics(tmp_path / run)[0]] for run in ("moba", "dense"))
    assert np.isfinite(moba).all() and moba != dense
    config = read_checkpoint(tmp_path / "moba" / "ckpt.pt")["model_config"]
    assert (config["attn"], config["attn_options"]) == ("moba", {"moba_block": 32, "moba_topk": 0})

    # a checkpoint is resumed as the function it trained: not MoBA as dense attention, nor the other way round,
    # nor MoBA with other blocks; the refusal says which flags trained it
    more = {**settings, "max_steps": 3}
    with pytest.raises(ConfigError, match=r"sparse attention \{'attn': 'moba', 'moba_block': 32, 'moba_topk': 0\} "
                                         r"but this run asks for none; resume with the settings that trained it: "
                                         r"--attn=moba --window=0 --moba_block=32 --moba_topk=0"):
        train.train(tiny_config(tmp_path / "moba", data_dir, resume=True, **{**more, "attn": "sdpa"}))
    with pytest.raises(ConfigError, match="resume with the settings that trained it: --attn=moba"):
        train.train(tiny_config(tmp_path / "moba", data_dir, resume=True, attn="moba", **{**more, "moba_block": 64}))
    with pytest.raises(ConfigError, match=r"sparse attention none but this run asks for \{'attn': 'moba', "
                                         r"'moba_block': 32, 'moba_topk': 0\}; resume with the settings that trained "
                                         r"it: --attn=sdpa --window=0"):
        train.train(tiny_config(tmp_path / "dense", data_dir, resume=True, attn="moba", **more))
    assert [r["step"] for r in read_metrics(tmp_path / "moba")[0]] == [0, 1]  # nothing ran
    # the dense checkpoint on another exact backend: the same function, resumed
    train.train(tiny_config(tmp_path / "dense", data_dir, resume=True, attn="naive", **more))
    assert [r["step"] for r in read_metrics(tmp_path / "dense")[0]] == [0, 1, 2]


def test_build_model_compares_what_the_checkpoint_and_the_run_compute(tmp_path):
    # build_model alone, on checkpoints made in memory: the same sparsity resumes (backend may change), another not
    def checkpoint(**attention_settings):
        model = GPT(tiny_config(tmp_path, "unused", **attention_settings).gpt_config())
        return {"model_config": asdict(model.config), "model": model.state_dict()}

    moba = checkpoint(attn="moba", moba_block=32)
    resumed = train.build_model(tiny_config(tmp_path, "unused", attn="moba", moba_block=32, dropout=0.1), moba)
    assert resumed.config.attn_options == {"moba_block": 32, "moba_topk": 3} and resumed.config.dropout == 0.1
    assert torch.equal(resumed.lm_head.weight, moba["model"]["lm_head.weight"])
    for run in (dict(attn="triton"), dict(attn="moba", moba_topk=1), dict(attn="sdpa", window=8)):
        with pytest.raises(ConfigError, match="--attn=moba --window=0 --moba_block=32 --moba_topk=3"):
            train.build_model(tiny_config(tmp_path, "unused", **run), moba)
    window = checkpoint(window=8)
    assert train.build_model(tiny_config(tmp_path, "unused", attn="naive", window=8), window).config.attn == "naive"
    with pytest.raises(ConfigError, match="resume with the settings that trained it: --attn=sdpa --window=8"):
        train.build_model(tiny_config(tmp_path, "unused", attn="moba", moba_block=32), window)


def test_two_process_ddp_matches_one_process_and_its_ranks_skip_together(tmp_path, data_dir):
    # same global batch: 2 ranks x 2 micro-steps x 1 sequence here (so no_sync is exercised), 1 process
    # x 4 sequences below. Rank 1 alone gets a NaN loss in step 2 (its 5th training forward; the gradients stay
    # finite, so only the flag the ranks share tells rank 0): both must skip the step, as the single process below
    # does; a rank that stepped while the other skipped would train another model, and the losses would part
    script = tmp_path / "nan_on_rank_1.py"
    script.write_text(f"import os, sys\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
                      "from helpers import nan_loss_forward\nimport train\nfrom model import GPT\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    GPT.forward = nan_loss_forward(GPT.forward, {4}, keep_grad=True)\n"
                      "train.main(sys.argv[1:])\n")
    settings = {**TINY, "max_steps": 5, "eval_interval": 2, "data_dir": data_dir, "out_dir": tmp_path / "ddp"}
    result = run_cli("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
                     *cli_flags(**{**settings, "batch_size": 1, "total_batch_size": 4 * 16}))
    assert result.returncode == 0, result.stderr[-3000:]
    # val: 2 batches x 1 sequence x 2 ranks there, the same 4 sequences as 1 batch here
    with pytest.MonkeyPatch.context() as m:
        m.setattr(GPT, "forward", nan_loss_forward(GPT.forward, {2}, keep_grad=True))
        train.train(tiny_config(tmp_path / "single", data_dir, max_steps=5, eval_interval=2, eval_iters=1))
    (ddp, ddp_val), (single, single_val) = read_metrics(tmp_path / "ddp"), read_metrics(tmp_path / "single")
    assert [(r["step"], r["skipped"], r["skipped_steps"]) for r in ddp] == [
        (0, False, 0), (1, False, 0), (2, True, 1), (3, False, 1), (4, False, 1)]
    assert [r["skipped"] for r in single] == [r["skipped"] for r in ddp]
    assert ddp[0]["tokens_per_s"] == pytest.approx(4 * 16 / (ddp[0]["step_ms"] / 1000))  # global tokens
    updated = [r["step"] for r in ddp if not r["skipped"]]
    np.testing.assert_allclose([ddp[s]["train_loss"] for s in updated], [single[s]["train_loss"] for s in updated],
                               rtol=1e-5)
    np.testing.assert_allclose([v["val_loss"] for v in ddp_val], [v["val_loss"] for v in single_val], rtol=1e-5)
    checkpoint = read_checkpoint(tmp_path / "ddp" / "ckpt.pt")
    assert len(checkpoint["rng"]) == 2  # one RNG state per rank
    assert checkpoint["skipped_steps"] == 1 and all(torch.isfinite(w).all() for w in checkpoint["model"].values())


def test_wandb_logs_offline_without_an_api_key(tmp_path, data_dir, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from `wandb login`
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    train.train(tiny_config(tmp_path / "run", data_dir, max_steps=2, eval_interval=1, wandb=True))
    run_id = read_checkpoint(tmp_path / "run" / "ckpt.pt")["wandb_run_id"]
    offline_runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1 and offline_runs[0].name.endswith(run_id)  # kept so --resume continues it


def test_train_step_benchmark_times_backends_side_by_side(data_dir, tmp_path, monkeypatch):
    from benchmarks import train_step

    # which backend's steps each timed_steps call ran: the warm-ups, then rounds whose order rotates
    timed, make_step, timed_steps = [], train_step.make_step, train_step.timed_steps

    def tagged_step(cfg, *args, **kwargs):
        step, device, dtype = make_step(cfg, *args, **kwargs)
        step.attn = cfg.attn
        return step, device, dtype

    monkeypatch.setattr(train_step, "make_step", tagged_step)
    monkeypatch.setattr(train_step, "timed_steps", lambda step, device, n, **kwargs: timed.append((step.attn, n))
                        or timed_steps(step, device, n, **kwargs))
    settings = {k: v for k, v in TINY.items() if k != "attn"}
    results = train_step.main(["--backends=naive,sdpa", "--warmup=1", "--rounds=2", "--steps=2", "--profile_steps=1",
                               f"--out_dir={tmp_path}", *cli_flags(**settings, data_dir=data_dir)])
    # the warm-ups; round 1; round 2, starting one further along (then the host-time and profiled steps)
    assert timed[:6] == [("naive", 1), ("sdpa", 1), ("naive", 2), ("sdpa", 2), ("sdpa", 2), ("naive", 2)]
    for name in ("naive", "sdpa"):
        r = results["backends"][name]
        assert len(r["step_ms"]) == 4 and r["median_ms"] > 0  # 2 rounds x 2 steps
        assert r["profile"]["kernels_ms"] == 0  # no GPU: the profiler saw no kernels
    assert "| naive |" in (tmp_path / "results.md").read_text()
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["settings"]["tokens_per_step"] == 4 * 16
    assert written["tuning"] == []  # neither backend tunes a Triton kernel


def test_runs_that_share_a_model_both_clip_its_gradients(data_dir):
    # an A/A pair ("triton,triton-again:attn=triton") trains one model: the second run's step must see its parameters
    from benchmarks import train_step
    from training.config import parse_args
    from training.distributed import World

    settings = {k: v for k, v in TINY.items() if k != "attn"}
    cfg = parse_args([*cli_flags(**settings, data_dir=data_dir), "--attn=naive", "--wandb=false"])
    built = {}
    first, second = (train_step.make_step(cfg, World(), built=built)[0] for _ in range(2))
    assert len(built) == 1 and first().grad_norm > 0 and second().grad_norm > 0


def test_train_step_records_the_tuners_choices():
    from benchmarks.train_step import tuner_choices

    log = [dict(kernel="bwd", key=(64, True, torch.bfloat16, 1024, 1024, ((2, False), (3, True))),
                times_ms={None: 0.30, (2, False): 0.29, (3, True): 0.31})]
    choices = tuner_choices(log)
    assert list(choices[0]["times_ms"]) == ["(2, False)", "tl", "(3, True)"]  # fastest first; None: the `tl` pair
    json.dumps(choices)  # the shape key holds a torch dtype: written as text


@pytest.mark.parametrize("name, category", [
    ("attn_bwd_dkdv", "attention"), ("attn_bwd_prepare", "attention"), ("attn_fwd_ws", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "attention"), ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"), ("triton_per_fused_native_layer_norm_0", "other"),
])
def test_train_step_sorts_kernels_by_name(name, category):
    from benchmarks.train_step import kernel_category

    assert kernel_category(name) == category


@pytest.mark.parametrize("gpu_name, peak", [
    ("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12), ("NVIDIA A10G", 70e12),
    ("NVIDIA GeForce RTX 4090", 165e12), ("Tesla T4", None),
])
def test_mfu_peak_is_looked_up_by_gpu_name(monkeypatch, gpu_name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu_name)
    assert peak_flops(torch.device("cuda:0")) == peak
    assert peak_flops(torch.device("cpu")) is None


def test_final_checkpoint_false_writes_none_at_the_end_but_keeps_the_periodic_ones(tmp_path, data_dir, capsys):
    # timing runs (benchmarks/scaling.py) leave out the end's checkpoint: a large model's takes minutes to write
    status, out, err = run_main(main_argv(tmp_path / "none", data_dir, max_steps=3, final_checkpoint=False), capsys)
    assert status == 0, err
    assert not (tmp_path / "none" / "ckpt.pt").exists() and len(read_metrics(tmp_path / "none")[0]) == 3
    assert "done at step 3; no final checkpoint (final_checkpoint=false)" in out
    status, _, err = run_main(main_argv(tmp_path / "periodic", data_dir, max_steps=3, checkpoint_interval=2,
                                        final_checkpoint=False), capsys)
    assert status == 0, err
    assert read_checkpoint(tmp_path / "periodic" / "ckpt.pt")["step"] == 2


def test_sigterm_mid_run_saves_a_loadable_checkpoint(tmp_path, data_dir):
    flags = cli_flags(**{**TINY, "max_steps": 100_000, "data_dir": data_dir, "out_dir": tmp_path})
    proc = subprocess.Popen([sys.executable, "train.py", *flags], cwd=ROOT, env=cpu_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 90
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline, "training did not start"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopped by SIGTERM" in stdout
    checkpoint = read_checkpoint(tmp_path / "ckpt.pt")
    last_logged = read_metrics(tmp_path)[0][-1]["step"]
    assert checkpoint["step"] == last_logged + 1  # saved after the step it was in, not mid-step
    assert not list(tmp_path.glob("*.tmp"))  # no half-written temporary file left behind


@pytest.mark.parametrize("where, settings, step", [
    ("evaluation", dict(eval_interval=1, eval_iters=10**7), 0),
    ("micro-steps", dict(total_batch_size=4 * 16 * 10**6), 0),  # a step of a million micro-batches
    ("sampling", dict(sample_interval=1, sample_tokens=10**7, sample_prompt="!"), 1),  # after step 0, at step 1
])
def test_sigterm_stops_at_once_wherever_the_run_is(tmp_path, data_dir, where, settings, step):
    flags = cli_flags(**{**TINY, "max_steps": 100_000, "data_dir": data_dir, "out_dir": tmp_path, **settings})
    proc = subprocess.Popen([sys.executable, "train.py", *flags], cwd=ROOT, env=cpu_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 90
    while not (tmp_path / "metrics.jsonl").exists():  # the logger opens it just before the loop starts
        assert proc.poll() is None and time.time() < deadline, "training did not start"
        time.sleep(0.2)
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    sent = time.time()
    stdout, stderr = proc.communicate(timeout=60)
    assert time.time() - sent < 10, f"the stop inside {where} took {time.time() - sent:.0f} s"
    assert proc.returncode == 0 and stderr == "", stderr[-3000:]
    assert stdout.splitlines()[-1].startswith(f"stopped by SIGTERM at step {step}; checkpoint ")
    checkpoint = read_checkpoint(tmp_path / "ckpt.pt")
    assert checkpoint["step"] == step
    # a cut step is read again on resume: the data position is where the step started
    assert checkpoint["train_loader"] == {"split": "train", "shard": 0, "position": step * 4 * 16}


def test_a_signal_during_the_set_up_ends_the_run_in_one_line(tmp_path, data_dir, monkeypatch, capsys):
    def slow_build(cfg, checkpoint):  # a download of GPT-2's weights, say, that the signal must cut short
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)

    monkeypatch.setattr(train, "build_model", slow_build)
    start = time.time()
    status, out, err = run_main(main_argv(tmp_path / "run", data_dir, max_steps=2), capsys)
    assert time.time() - start < 30 and status == 1
    assert err.strip().splitlines() == ["train.py: stopped by SIGTERM before the first step; nothing was saved"]
    assert not (tmp_path / "run").exists()


def test_a_second_signal_exits_at_once_in_one_line():
    # under DDP the first signal only sets the flag the ranks read after the step; the second must not wait for it
    script = ("import os, signal, time\nfrom training.stop import StopSignal\n"
              "with StopSignal(immediate=False):\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(60)\n")
    start = time.time()
    result = run_cli("-c", script, timeout=60)
    assert time.time() - start < 30 and result.returncode == 128 + signal.SIGTERM
    assert result.stderr.splitlines() == ["train.py: second SIGTERM: exiting at once, without saving"]


def test_lr_schedule_warmup_peak_and_end():
    cfg = TrainConfig(learning_rate=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    assert train.lr_at(0, cfg) == pytest.approx(1e-4)  # 1/10 of the peak: never 0
    assert train.lr_at(4, cfg) == pytest.approx(5e-4)
    assert train.lr_at(9, cfg) == pytest.approx(1e-3) == train.lr_at(10, cfg)  # the peak
    assert train.lr_at(60, cfg) == pytest.approx((1e-3 + 1e-4) / 2)  # half way down the cosine
    assert train.lr_at(110, cfg) == pytest.approx(1e-4) == train.lr_at(500, cfg)  # min_lr from the end on
    decay = [train.lr_at(s, cfg) for s in range(10, 111)]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    short = TrainConfig(learning_rate=1e-3, min_lr=0.0, warmup_steps=0, max_steps=100, lr_decay_steps=50)
    assert train.lr_at(0, short) == 1e-3 and train.lr_at(50, short) == 0.0 == train.lr_at(99, short)


def test_flags_and_config_files_apply_left_to_right(tmp_path):
    config = tmp_path / "cfg.py"
    config.write_text("import math\n_exponent = 3\nbatch_size = 2 ** _exponent\nlearning_rate = 1\ncompile = True\n")
    cfg = parse_args([str(config), "--compile=0", "--wandb=FALSE", "--resume", "--dropout=0.25", "--attn=naive"])
    assert (cfg.batch_size, cfg.compile, cfg.wandb, cfg.resume) == (8, False, False, True)
    assert (cfg.dropout, cfg.attn) == (0.25, "naive")
    assert isinstance(cfg.learning_rate, float) and cfg.learning_rate == 1.0  # an int in a float field is widened
    assert parse_args(["--batch_size=2", str(config)]).batch_size == 8  # the file came last: it wins


def test_runs_of_other_configs_and_backends_keep_apart(tmp_path, monkeypatch):
    smoke = str(ROOT / "configs" / "smoke_cpu.py")
    assert parse_args([smoke]).out_dir == os.path.join("out", "smoke_cpu-sdpa")
    triton_window = parse_args([smoke, "--attn=triton", "--window=16"])
    assert triton_window.out_dir == os.path.join("out", "smoke_cpu-triton-window16")
    assert parse_args(["--doc_mask=true"]).out_dir == os.path.join("out", "default-sdpa-docs")
    assert parse_args([smoke, "--name=mine"]).out_dir == os.path.join("out", "mine-sdpa")
    assert parse_args([smoke, "--out_dir=elsewhere"]).out_dir == "elsewhere"
    # wandb: runs grouped by config, each named by its config, size and attention
    import wandb

    seen = {}
    monkeypatch.setattr(wandb, "init", lambda **kw: seen.update(kw) or SimpleNamespace(id="x", finish=lambda: None))
    RunLogger(parse_args([smoke, "--attn=naive", "--wandb=true", f"--out_dir={tmp_path}"]), 0, None, 3_321_344).close()
    assert (seen["group"], seen["name"]) == ("smoke_cpu", "smoke_cpu-3.32M-naive")


@pytest.mark.parametrize("cuda, argv, config", [
    (False, [], "shakespeare_cpu.py"),
    (True, [], "shakespeare.py"),
    (True, ["--device=cpu"], "shakespeare_cpu.py"),  # the device asked for decides, not the one present
    (False, ["--attn=naive"], "shakespeare_cpu.py"),
])
def test_without_a_config_file_the_machine_picks_one_and_says_so(monkeypatch, capsys, cuda, argv, config):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    chosen = train.with_default_config(argv)
    assert chosen == [str(ROOT / "configs" / config), *argv]
    assert capsys.readouterr().out.startswith(f"no config file given: {os.path.relpath(ROOT / 'configs' / config)} (")
    assert train.with_default_config(["configs/smoke_cpu.py", *argv]) == ["configs/smoke_cpu.py", *argv]


def test_a_fresh_run_leaves_no_samples_of_an_earlier_one(tmp_path):
    (tmp_path / "samples.txt").write_text("--- step 40 ---\nan earlier run's text\n")
    RunLogger(TrainConfig(out_dir=str(tmp_path), wandb=False, sample_interval=0, resume=True), 0, None).close()
    assert (tmp_path / "samples.txt").exists()  # a resumed run keeps its own
    RunLogger(TrainConfig(out_dir=str(tmp_path), wandb=False, sample_interval=0), 0, None).close()
    assert not (tmp_path / "samples.txt").exists()


def test_sparse_attention_flags_reach_the_model_config():
    assert parse_args(["--attn=triton", "--window=256"]).gpt_config().sparsity() == {"window": 256}
    moba = parse_args(["--attn=moba", "--moba_block=128", "--moba_topk=3"]).gpt_config()
    assert moba.attn == "moba" and moba.attn_options == {"moba_block": 128, "moba_topk": 3}
    assert moba.sparsity() == {"attn": "moba", "moba_block": 128, "moba_topk": 3}
    cfg = parse_args([str(ROOT / "configs" / "shakespeare_sparse.py"), "--attn=moba"])
    assert (cfg.model, cfg.block_size, cfg.moba_block, cfg.moba_topk, cfg.window) == ("gpt2", 1024, 128, 3, 0)
    assert parse_args([str(ROOT / "configs" / "shakespeare_sparse.py"), "--window=256"]).gpt_config().window == 256


def test_attention_settings_pass_the_chosen_backends_options_only():
    # the moba_* flags are MoBA's options: a dense run keeps them (as flags) but hands its backend none
    assert parse_args(["--attn=moba", "--moba_block=128"]).attention_settings() == {
        "attn": "moba", "window": 0, "doc_mask": False, "attn_options": {"moba_block": 128, "moba_topk": 3}}
    assert parse_args(["--attn=sdpa", "--moba_block=128", "--window=8"]).attention_settings() == {
        "attn": "sdpa", "window": 8, "doc_mask": False, "attn_options": {}}
    assert parse_args(["--attn=sdpa", "--moba_block=128"]).gpt_config().attn_options == {}


@pytest.mark.parametrize("argv, message", [
    (["--batchsize=8"], "unknown setting 'batchsize'"),
    (["--batch_size=eight"], "--batch_size takes an int, got 'eight'"),
    (["--learning_rate=fast"], "--learning_rate takes a float"),
    (["--compile=yes"], "--compile takes true/false/1/0"),
    (["--batch_size"], "--batch_size needs a value"),
    (["--attn=flashy"], "unknown attention backend 'flashy'; choose one of: compile, cuda, flex, moba, naive, sdpa, "
                        "triton"),
    (["--init_from=gpt2", "--attn=flashy"], "unknown attention backend 'flashy'; choose one of"),
    (["--attn=moba", "--window=8"], "model: window=8 with attn='moba': that backend takes no masks"),
    (["--window=-1"], "GPTConfig.window must be an int >= 0"),
    (["--attn=moba", "--moba_topk=-1"], "model: moba_topk must be an int >= 0"),
    (["--init_from=gpt2", "--attn=moba", "--moba_block=8"], "model: moba_block must be an int >= 16"),
    (["--batch_size=3", "--block_size=16", "--total_batch_size=100"], "total_batch_size=100 is not a multiple of"),
    (["--n_layer=2", "--n_head=3", "--n_embd=32"], "n_embd=32 is not divisible by n_head=3"),
    (["--model=gpt5"], "unknown preset 'gpt5'"),
    (["--dtype=fp8"], "unknown dtype='fp8'"),
    (["--device=tpu"], "unknown device='tpu'"),
    (["--max_steps=0"], "max_steps must be at least 1"),
    (["--warmup_steps=50", "--max_steps=10"], "warmup_steps=50 is past the end of the decay"),
    (["--min_lr=1e-2", "--learning_rate=1e-3"], "need 0 <= min_lr <= learning_rate"),
    (["--beta2=1.5"], "beta2 must be in [0, 1)"),
    (["--nonfinite=ignore"], "unknown nonfinite='ignore'; choose one of: skip, stop, off"),
    (["--ddp_reduce_dtype=float16"], "unknown ddp_reduce_dtype='float16'; choose one of: float32, bfloat16"),
    (["--ddp_reduce_dtype=bfloat16", "--parallel=fsdp"], "ddp_reduce_dtype is DDP's; --parallel=fsdp"),
    (["--max_skipped_steps=0"], "max_skipped_steps must be at least 1, got 0"),
    (["--tf32=maybe"], "--tf32 takes true/false/1/0"),
    (["configs/no_such_config.py"], "config file 'configs/no_such_config.py' not found"),
    (["batch_size=8"], "'batch_size=8' is neither a config file nor a flag; flags are written --key=value"),
    (["--lr=1e-3"], "unknown setting 'lr' in the flag '--lr=1e-3'; did you mean learning_rate?"),
    (["--n_embed=64"], "unknown setting 'n_embed' in the flag '--n_embed=64'; did you mean n_embd?"),
    (["--epochs=3"], "unknown setting 'epochs' in the flag '--epochs=3'; valid settings: data_dir, name, out_dir"),
])
def test_bad_settings_name_the_problem(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert message in str(err.value)


def test_bad_config_file_names_the_key(tmp_path):
    config = tmp_path / "cfg.py"
    config.write_text("batch_sise = 8\n")
    with pytest.raises(ConfigError, match=rf"unknown setting 'batch_sise' in {config}"):
        parse_args([str(config)])
    config.write_text("batch_size = '8'\n")
    with pytest.raises(ConfigError, match="batch_size must be int, got str '8'"):
        parse_args([str(config)])


def test_wandb_requested_but_missing_says_how_to_turn_it_off(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails as if not installed
    with pytest.raises(ConfigError, match="pip install wandb, or pass --wandb=false"):
        parse_args(["--wandb=true"])
    assert parse_args(["--wandb=false"]).wandb is False


def test_batch_that_does_not_split_over_ranks_is_an_error():
    cfg = TrainConfig(batch_size=4, block_size=16, total_batch_size=2 * 4 * 16)
    assert cfg.grad_accum_steps(1) == 2 and cfg.grad_accum_steps(2) == 1
    with pytest.raises(ConfigError, match=r"batch_size \* block_size \* world_size = 4 \* 16 \* 4 = 256"):
        cfg.grad_accum_steps(4)


@pytest.mark.parametrize("overrides, error, message", [
    (dict(resume=True), CheckpointError, "no checkpoint at .*ckpt.pt; drop --resume to start a new run"),
    (dict(data_dir="/no/such/folder"), ConfigError, "data_dir '/no/such/folder' does not exist"),
    (dict(data_dir="unindexed"), ConfigError, "has no index.json, which the preparation script writes"),
    (dict(vocab_size=50), ConfigError, r"train_000000.npy holds token id 63, and the model's vocabulary has 50"),
    (dict(block_size=16, batch_size=2000), ConfigError, "fewer than one batch needs"),
    (dict(sample_interval=5, sample_prompt="a long prompt"), ConfigError, "holds token ids >= vocab_size=64"),
])
def test_bad_runs_fail_before_training(tmp_path, data_dir, overrides, error, message):
    if overrides.get("data_dir") == "unindexed":  # shards as an older version, or an unfinished preparation, left them
        overrides["data_dir"] = str(tmp_path / "data")
        shutil.copytree(data_dir, overrides["data_dir"], ignore=shutil.ignore_patterns("index.json"))
    with pytest.raises(error, match=message):
        train.train(tiny_config(tmp_path / "run", **{"data_dir": data_dir, **overrides}))
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_cli_prints_the_error_without_a_traceback():
    result = run_cli("train.py", "--attn=flashy", "--device=cpu", timeout=60)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "train.py: error: attn: unknown attention backend 'flashy'; choose one of: compile, cuda, flex, moba, naive, "
        "sdpa, triton"]
    assert "Traceback" not in result.stdout


# --- non-finite steps ----------------------------------------------------------------------------------------------

def main_argv(out_dir, data_dir, **overrides) -> list[str]:
    """train.py's command line for tiny_config's settings."""
    return cli_flags(**{**TINY, "out_dir": out_dir, "data_dir": data_dir, **overrides})


def kept_checkpoints(monkeypatch) -> list[dict]:
    """What every Checkpoints.save of the run wrote, copied when it was saved: step, weights, Adam's step count for
    the first parameter, skipped_steps."""
    saved, save = [], Checkpoints.save

    def keep(self, state):
        saved.append({"step": state["step"], "skipped_steps": state["skipped_steps"],
                      "model": {k: v.clone() for k, v in state["model"].items()},
                      "adam_steps": state["optimizer"]["state"][0]["step"].item()})
        save(self, state)

    monkeypatch.setattr(Checkpoints, "save", keep)
    return saved


def assert_finite_checkpoint(path) -> dict:
    state = read_checkpoint(str(path))
    assert all(torch.isfinite(w).all() for w in state["model"].values()), f"{path} holds non-finite weights"
    return state


def test_a_nan_step_is_skipped_logged_and_changes_nothing(tmp_path, data_dir, monkeypatch, capsys):
    saved = kept_checkpoints(monkeypatch)
    monkeypatch.setattr(GPT, "forward", nan_loss_forward(GPT.forward, {2}))
    status, out, err = run_main(main_argv(tmp_path, data_dir, max_steps=5, checkpoint_interval=1, log_interval=3),
                                capsys)
    assert status == 0, err
    records = read_metrics(tmp_path)[0]
    assert all(set(r) == TRAIN_PY_KEYS for r in records)
    # every log_interval steps and the last, and a skipped step whenever it happens
    assert [(r["step"], r["skipped"], r["skipped_steps"]) for r in records] == [
        (0, False, 0), (2, True, 1), (3, False, 1), (4, False, 1)]
    # the skipped step's NaN loss and norm are written as null: metrics.jsonl stays strict JSON
    assert records[1]["train_loss"] is None and records[1]["grad_norm"] is None
    assert all(np.isfinite(r["train_loss"]) for r in records if not r["skipped"])
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()
    assert "step 2/5 | skipped: loss nan" in out and "1 skipped in all, 1 in a row (stops at 5)" in out
    assert "done at step 5; 1 step(s) skipped for non-finite values; checkpoint" in out
    # checkpoints after steps 0..4: step 2 (saved as 3) made no update, the steps around it did
    assert [c["step"] for c in saved] == [1, 2, 3, 4, 5]
    assert [c["adam_steps"] for c in saved] == [1, 2, 2, 3, 4]
    assert [c["skipped_steps"] for c in saved] == [0, 0, 1, 1, 1]
    before, after, next_one = (saved[i]["model"] for i in (1, 2, 3))
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not all(torch.equal(after[k], next_one[k]) for k in after)
    assert assert_finite_checkpoint(tmp_path / "ckpt.pt")["skipped_steps"] == 1


@pytest.mark.parametrize("nonfinite, max_skipped, nan_calls, last_nan, in_a_row", [
    ("skip", 2, {4, 5}, 5, 2),  # max_skipped_steps in a row
    ("stop", 5, {5}, 5, 1),  # the first
])
def test_non_finite_steps_in_a_row_stop_the_run_without_saving(tmp_path, data_dir, monkeypatch, capsys, nonfinite,
                                                                max_skipped, nan_calls, last_nan, in_a_row):
    monkeypatch.setattr(GPT, "forward", nan_loss_forward(GPT.forward, nan_calls))
    argv = main_argv(tmp_path, data_dir, max_steps=10, checkpoint_interval=2, nonfinite=nonfinite,
                     max_skipped_steps=max_skipped)
    status, out, err = run_main(argv, capsys)
    assert status == 1 and "Traceback" not in err + out
    assert err.splitlines()[-1] == (
        f"train.py: error: {in_a_row} step(s) in a row had a non-finite loss or gradient norm (the last at step "
        f"{last_nan}, --nonfinite={nonfinite}); stopped without saving. Lower --learning_rate or check the data; "
        f"{tmp_path / 'ckpt.pt'} is the last good checkpoint: continue with --resume")
    records = read_metrics(tmp_path)[0]
    assert [(r["step"], r["skipped_steps"]) for r in records if r["skipped"]] == [
        (step, i + 1) for i, step in enumerate(sorted(nan_calls))]
    assert records[-1]["step"] == last_nan
    # the newest checkpoint is the last one saved before the stop: it passes its check, its weights are finite
    assert assert_finite_checkpoint(tmp_path / "ckpt.pt")["step"] == 4
    assert read_checkpoint(str(tmp_path / "ckpt.prev.pt"))["step"] == 2
    assert not list(tmp_path.glob("*.tmp"))
    # and it continues, once the cause is gone
    monkeypatch.undo()
    status, out, err = run_main([*argv, "--resume"], capsys)
    assert status == 0, err
    assert assert_finite_checkpoint(tmp_path / "ckpt.pt")["step"] == 10


def test_non_finite_steps_apart_do_not_stop_a_run(tmp_path, data_dir, monkeypatch, capsys):
    monkeypatch.setattr(GPT, "forward", nan_loss_forward(GPT.forward, {1, 3, 5}))
    status, out, err = run_main(main_argv(tmp_path, data_dir, max_steps=7, max_skipped_steps=2, log_interval=100),
                                capsys)
    assert status == 0, err
    records = read_metrics(tmp_path)[0]
    assert [(r["step"], r["skipped"], r["skipped_steps"]) for r in records] == [
        (0, False, 0), (1, True, 1), (3, True, 2), (5, True, 3), (6, False, 3)]
    assert assert_finite_checkpoint(tmp_path / "ckpt.pt")["skipped_steps"] == 3


def test_nonfinite_off_lets_the_nan_through_and_only_the_save_refuses_it(tmp_path, data_dir, monkeypatch, capsys):
    # off: no check at all; the optimizer steps on the NaN gradients, the weights turn NaN, and the loss after them;
    # the records say nothing was skipped. What stops the run is the check before each save: nothing non-finite is
    # ever written, the last good checkpoint stays the newest
    monkeypatch.setattr(GPT, "forward", nan_loss_forward(GPT.forward, {2}))
    status, out, err = run_main(main_argv(tmp_path, data_dir, max_steps=6, checkpoint_interval=2, nonfinite="off"),
                                capsys)
    assert status == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (
        f"train.py: error: the weights hold non-finite values at step 4, so nothing was saved; lower --learning_rate "
        f"or --grad_clip; {tmp_path / 'ckpt.pt'} is the last good checkpoint: continue with --resume")
    records = read_metrics(tmp_path)[0]
    assert [r["step"] for r in records] == [0, 1, 2, 3] and not any(r["skipped"] for r in records)
    assert [r["train_loss"] is not None for r in records] == [True, True, False, False]  # null: not finite
    assert assert_finite_checkpoint(tmp_path / "ckpt.pt")["step"] == 2


@pytest.mark.parametrize("nonfinite", ["stop", "off"])
def test_a_non_finite_stop_before_any_checkpoint_points_at_none(tmp_path, data_dir, monkeypatch, capsys, nonfinite):
    # stop: the first NaN ends the run; off: the NaN weights are refused by the save at the end. Either way no
    # checkpoint was ever written, so the message must not send the user to one (--resume would fail: no checkpoint)
    monkeypatch.setattr(GPT, "forward", nan_loss_forward(GPT.forward, {0}))
    status, out, err = run_main(main_argv(tmp_path, data_dir, max_steps=3, nonfinite=nonfinite), capsys)
    assert status == 1 and err.splitlines()[-1].startswith("train.py: error: ") and "Traceback" not in err
    assert not (tmp_path / "ckpt.pt").exists() and not (tmp_path / "ckpt.prev.pt").exists()
    assert f"{tmp_path / 'ckpt.pt'} is the last good checkpoint" not in err and "--resume" not in err, err


def tiny_train_step(tmp_path, data_dir, check_finite: bool, scaler: bool = False):
    from training.step import TrainStep

    torch.manual_seed(0)
    model = GPT(tiny_config(tmp_path, data_dir).gpt_config())
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
    loader = train.open_loader(tiny_config(tmp_path, data_dir), "train", train.World(), VOCAB)
    step = TrainStep(model, model.parameters(), optimizer, torch.amp.GradScaler("cpu", enabled=scaler),
                     loader.next_batch, nullcontext(), torch.device("cpu"), grad_accum=1, grad_clip=1.0, world_size=2,
                     no_sync=None, check_finite=check_finite)
    return step, model, optimizer


def adam_steps(optimizer) -> set[float]:
    return {state["step"].item() for state in optimizer.state.values()} or {0.0}


@pytest.mark.parametrize("this_rank, other_rank, check_finite, steps", [
    ("finite", "finite", True, True),
    ("finite", "nan", True, False),  # another rank's NaN: this one skips too
    ("nan", "finite", True, False),
    ("nan", "finite", False, True),  # nonfinite=off: no check
])
@pytest.mark.parametrize("scaler", [False, True], ids=["no_scaler", "fp16_scaler"])
def test_every_rank_skips_when_any_rank_saw_a_non_finite_loss(tmp_path, data_dir, monkeypatch, this_rank, other_rank,
                                                              check_finite, steps, scaler):
    # two ranks without a process group: the all-reduce is replaced by this rank's values plus the other rank's. The
    # NaN is in the loss alone: the gradients, and so the norm, stay finite, and only the shared flag can tell. With
    # the fp16 loss scaler (enabled here on the CPU) the check judges the loss alone, and must skip just the same
    from training import step as step_module

    def all_reduce(tensor):  # [loss, stop flag, not-finite flag]
        return tensor + torch.tensor([float("nan") if other_rank == "nan" else 3.0, 0.0, float(other_rank == "nan")])

    monkeypatch.setattr(step_module, "sum_across_ranks", all_reduce)
    train_step, model, optimizer = tiny_train_step(tmp_path, data_dir, check_finite, scaler)
    if this_rank == "nan":
        monkeypatch.setattr(GPT, "forward", nan_loss_forward(GPT.forward, {0}, keep_grad=True))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train_step(1e-2, False).wait()
    assert result.finite == (this_rank == other_rank == "finite" or not check_finite)
    assert math.isfinite(result.grad_norm) and result.stop_votes == 0
    changed = not all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert (changed, adam_steps(optimizer)) == (steps, {1.0} if steps else {0.0})
    assert not hasattr(optimizer, "found_inf")  # the next step starts clean
    if steps:
        return
    # a skipped step leaves the moments as they were (none yet), and the next one steps as a first step would
    assert all(torch.count_nonzero(s["exp_avg"]) == 0 for s in optimizer.state.values())
    monkeypatch.setattr(step_module, "sum_across_ranks", lambda tensor: tensor + torch.tensor([3.0, 0.0, 0.0]))
    assert train_step(1e-2, False).wait().finite and adam_steps(optimizer) == {1.0}


def test_train_step_refuses_an_optimizer_that_cannot_skip_on_the_device(tmp_path, data_dir):
    from training.step import TrainStep

    model = GPT(tiny_config(tmp_path, data_dir).gpt_config())
    unfused = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="build it with fused=True"):
        TrainStep(model, model.parameters(), unfused, torch.amp.GradScaler("cpu", enabled=False), None,
                  nullcontext(), torch.device("cpu"), 1, 1.0, 1, None, check_finite=True)


# --- the wrong machine, the wrong checkpoint ------------------------------------------------------------------------

def test_triton_on_a_cpu_without_the_interpreter_is_refused_before_anything_is_written(tmp_path, data_dir):
    out_dir = tmp_path / "run"
    result = run_cli("train.py", "--attn=triton", *cli_flags(data_dir=data_dir, out_dir=out_dir, wandb=False),
                     env=cpu_env(TRITON_INTERPRET=None), timeout=60)
    assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: --attn=triton: the triton attention kernels run "
                                                   "on a CUDA GPU, and this runs on cpu")
    assert "sdpa" in lines[0] and "TRITON_INTERPRET=1" in lines[0]
    assert not out_dir.exists()


@pytest.mark.parametrize("flags, message", [
    (["--attn=moba", "--block_size=64", "--moba_block=32"],
     "--attn=moba: the triton attention kernels run on a CUDA GPU, and this runs on cpu; use a dense backend such as "
     "sdpa there, or set TRITON_INTERPRET=1"),
    (["--device=cuda"], "device='cuda' but torch sees no CUDA GPU; pass --device=cpu"),
    (["--attn=flex", "--doc_mask=true"], "--attn=flex: FlexAttention computes gradients on a CUDA GPU only, and this "
     "runs on cpu; use sdpa or naive there"),
    (["--attn=cuda"], "--attn=cuda: the cuda attention kernels run on a CUDA GPU, and this runs on cpu; use a dense "
     "backend such as sdpa there"),
])
def test_the_wrong_machine_is_refused_in_one_line(tmp_path, data_dir, monkeypatch, capsys, flags, message):
    # in this process: Triton's interpreter read as off (TRITON_INTERPRET unset), CUDA as missing
    from attention.flash import device

    monkeypatch.setattr(device, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status, out, err = run_main([f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'run'}", "--wandb=false", *flags],
                                capsys)
    lines = err.strip().splitlines()
    assert status == 1 and len(lines) == 1 and lines[0].startswith(f"train.py: error: {message}")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["a file", "under a file", "read-only"])
def test_an_out_dir_that_cannot_be_written_is_refused_in_one_line(tmp_path, data_dir, monkeypatch, capsys, where):
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "locked").mkdir(mode=0o555)
    if os.geteuid() == 0:  # root may write anywhere: let the folder read as read-only, as it does to anyone else
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: path != str(tmp_path / "locked") and access(path, mode))
    out_dir = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "run",
               "read-only": tmp_path / "locked" / "run"}[where]
    status, out, err = run_main(main_argv(out_dir, data_dir, max_steps=2), capsys)
    lines = err.strip().splitlines()
    assert status == 1 and len(lines) == 1 and "Traceback" not in out + err
    assert lines[0].startswith(f"train.py: error: out_dir '{out_dir}' cannot be ") and "pass --out_dir=" in lines[0]
    assert (tmp_path / "file").read_text() == "not a folder" and not list((tmp_path / "locked").iterdir())


@pytest.mark.parametrize("flags, offline, message", [
    (["--block_size=2048"], None, "block_size=2048 is longer than the model's context of 1024 positions; pass "
                                  "--block_size=1024 or less"),
    ([], None, "init_from=gpt2: the weights are not in the Hugging Face cache and 127.0.0.1 cannot be reached"),
    ([], "1", "init_from=gpt2: the weights are not in the Hugging Face cache, and HF_HUB_OFFLINE is set; run once "
              "online"),
])
def test_init_from_gpt2_offline_fails_in_one_line_before_any_download(tmp_path, data_dir, flags, offline, message):
    # a Hub that refuses connections, and an empty cache: what a machine without network sees, without its waits
    env = cpu_env(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE=offline)
    start = time.time()
    flags = ["--init_from=gpt2", *cli_flags(data_dir=data_dir, out_dir=tmp_path / "run", wandb=False), *flags]
    result = run_cli("train.py", *flags, env=env, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stdout + result.stderr
    assert lines[0].startswith(f"train.py: error: {message}")
    assert time.time() - start < 60 and not (tmp_path / "hf").exists()  # no retries, nothing fetched


def test_build_model_refuses_a_checkpoint_of_another_model(tmp_path):
    cfg = tiny_config(tmp_path, "unused")
    model = GPT(cfg.gpt_config())
    good = {"model_config": asdict(model.config), "model": model.state_dict()}
    assert train.build_model(cfg, good).config == model.config
    for model_config in ({**good["model_config"], "rotary": True}, {**good["model_config"], "n_head": "two"}, [1, 2]):
        with pytest.raises(ConfigError, match=r"^the checkpoint's model_config does not describe a model of this "
                                              r"version \(.*\); resume it with the version that wrote it"):
            train.build_model(cfg, {**good, "model_config": model_config})
    wider = {**good, "model_config": {**good["model_config"], "n_embd": 64}}
    fewer = {**good, "model": {k: v for k, v in good["model"].items() if k != "lm_head.weight"}}
    for checkpoint, reason in ((wider, "size mismatch for"), (fewer, "Missing key")):
        with pytest.raises(ConfigError, match=rf"^the checkpoint's weights do not fit its own model_config \({reason}.*"
                                              r"\); it was not written by this trainer, or was changed after$"):
            train.build_model(cfg, checkpoint)


def test_a_checkpoint_whose_data_state_does_not_fit_is_refused(tmp_path, data_dir, capsys):
    argv = main_argv(tmp_path, data_dir, max_steps=2)
    assert run_main(argv, capsys)[0] == 0
    checkpoints = Checkpoints(str(tmp_path))
    state = checkpoints.load()
    checkpoints.save({**state, "train_loader": {**state["train_loader"], "shard": 5}})  # digest and all
    status, out, err = run_main([*argv, "--max_steps=4", "--resume"], capsys)
    assert status == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("train.py: error: the checkpoint's optimizer or data state does not fit this run (the state "
                          "points at shard 5") and "resume with the settings and data_dir that trained it" in err


def test_train_step_benchmark_runs_flag_variants_on_one_model(data_dir, tmp_path, monkeypatch):
    from benchmarks import train_step

    builds, make_step = [], train_step.make_step

    def counted(cfg, world, compile_mode="default", built=None):
        out = make_step(cfg, world, compile_mode, built)
        builds.append((cfg.nonfinite, len(built)))
        return out

    monkeypatch.setattr(train_step, "make_step", counted)
    settings = {k: v for k, v in TINY.items() if k != "attn"}
    results = train_step.main(["--backends=checked:attn=naive,unchecked:attn=naive+nonfinite=off,sdpa", "--warmup=1",
                               "--rounds=1", "--steps=1", "--profile_steps=0", f"--out_dir={tmp_path}",
                               *cli_flags(**settings, data_dir=data_dir)])
    assert list(results["backends"]) == ["checked", "unchecked", "sdpa"]
    assert builds == [("skip", 1), ("off", 1), ("skip", 2)]  # nonfinite alone differs: the same model
