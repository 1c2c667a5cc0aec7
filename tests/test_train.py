"""train.py on the CPU with a tiny model: learning, exact resume, DDP, the records it writes, its settings and config
files. Signals are in test_train_signals.py, refusals (bad input, the wrong machine or checkpoint) in
test_train_refusals.py, non-finite steps in test_nonfinite.py.

Most runs call train() or main() in-process (a few hundred ms each); the CLI, torchrun, SIGTERM and missing-interpreter
tests start real processes because the process boundary (or the environment a process starts with) is what they test.
test_faults.py kills runs with SIGKILL and damages their checkpoints and data; test_checkpoint.py tests the checkpoint
files themselves.
"""
import json
import os
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import (ROOT, TINY_RUN, TINY_VOCAB, TRAIN_PY_KEYS, cli_flags, nan_loss_forward, read_metrics, run_cli,
                     tiny_config)

import train
from model import GPT, GPTConfig
from training.checkpoint import read_checkpoint
from training.config import ConfigError, TrainConfig, parse_args
from training.logger import RunLogger, peak_flops
from training.preflight import set_tf32


VAL_KEYS = {"step", "val_loss", "attn"}


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
    assert first == pytest.approx(np.log(TINY_VOCAB), abs=0.3)  # small init: near-uniform predictions
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
    # against the fastest step read the usual way (a busy CPU stretches some steps tenfold, none shrinks one to a
    # read's fraction of a millisecond)
    fastest_usual = min(ms for step, ms in times.items() if step not in (3, 7, 8))
    assert all(times[step] > fastest_usual / 10 for step in (3, 7, 8)), times


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


@pytest.mark.parametrize("grad_clip", [1e-3, 1e3], ids=["clipped", "under_the_clip"])
@pytest.mark.parametrize("scaler", [False, True], ids=["clip_in_the_update", "fp16_scaler"])
def test_the_step_clips_as_clip_grad_norm_does(tmp_path, data_dir, grad_clip, scaler):
    # without a loss scaler the clip rides on the fused update's grad_scale; with one it scales the gradients first.
    # Both must leave the moments (linear in the clipped gradient) and the weights as clip_grad_norm_ and a step do
    from contextlib import nullcontext

    from training.step import TrainStep

    cfg = tiny_config(tmp_path, data_dir)
    x, y = train.open_loader(cfg, "train", train.World(), TINY_VOCAB).next_batch()
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = GPT(cfg.gpt_config())
        runs.append((model, model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))))
    (ours, our_optimizer), (ref, ref_optimizer) = runs
    step = TrainStep(ours, ours.parameters(), our_optimizer, torch.amp.GradScaler("cpu", enabled=scaler),
                     lambda: (x, y), nullcontext(), torch.device("cpu"), grad_accum=1, grad_clip=grad_clip,
                     world_size=1, no_sync=None, check_finite=True)
    result = step(1e-2, False).wait()
    ref(x, y)[1].backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), grad_clip)
    ref_optimizer.step()
    assert result.grad_norm == pytest.approx(norm.item(), rel=1e-5) and (norm > grad_clip) == (grad_clip < 1)
    for ours_state, ref_state in zip(our_optimizer.state.values(), ref_optimizer.state.values()):
        torch.testing.assert_close(ours_state["exp_avg"], ref_state["exp_avg"], rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(ours.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-7)
    assert not hasattr(our_optimizer, "grad_scale")  # the next step starts clean


def test_init_from_a_weights_file_starts_from_those_weights(tmp_path, data_dir):
    torch.manual_seed(1)
    source = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=TINY_VOCAB))
    # saved in Hugging Face's GPT-2 layout, whose Conv1D layers store their weights transposed
    conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
    torch.save({k: v.t() if k.endswith(conv1d) else v for k, v in source.state_dict().items()}, tmp_path / "w.pt")
    (tmp_path / "config.json").write_text('{"n_head": 2}')
    tokens = torch.from_numpy(np.load(Path(data_dir) / "train_000000.npy")[:4 * 16 + 1].astype(np.int64))
    _, first_loss = source(tokens[:-1].view(4, 16), tokens[1:].view(4, 16))

    train.train(tiny_config(tmp_path / "run", data_dir, init_from=str(tmp_path / "w.pt"), max_steps=2))
    assert read_metrics(tmp_path / "run")[0][0]["train_loss"] == pytest.approx(first_loss.item(), rel=1e-6)
    assert read_checkpoint(tmp_path / "run" / "ckpt.pt")["model_config"]["n_layer"] == 1  # not TINY_RUN's 2


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
    settings = {**TINY_RUN, "max_steps": 5, "eval_interval": 2, "data_dir": data_dir, "out_dir": tmp_path / "ddp"}
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
    monkeypatch.setattr(train_step, "timed_steps", lambda step, n: timed.append((step.attn, n)) or timed_steps(step, n))
    settings = {k: v for k, v in TINY_RUN.items() if k != "attn"}
    results = train_step.main(["--backends=naive,sdpa", "--warmup=1", "--rounds=2", "--steps=2", "--profile_steps=1",
                               f"--out_dir={tmp_path}", *cli_flags(**settings, data_dir=data_dir)])
    # the warm-ups; round 1; round 2, starting one further along (then the profiled steps)
    assert timed[:6] == [("naive", 1), ("sdpa", 1), ("naive", 2), ("sdpa", 2), ("sdpa", 2), ("naive", 2)]
    for name in ("naive", "sdpa"):
        r = results["backends"][name]
        assert len(r["step_ms"]) == 4 and r["median_ms"] > 0 and r["host_ms"] > 0  # 2 rounds x 2 steps
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

    settings = {k: v for k, v in TINY_RUN.items() if k != "attn"}
    cfg = parse_args([*cli_flags(**settings, data_dir=data_dir), "--attn=naive", "--wandb=false"])
    built = {}
    first, second = (train_step.make_step(cfg, World(), built=built)[0] for _ in range(2))
    assert len(built) == 1 and first().wait().grad_norm > 0 and second().wait().grad_norm > 0


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


def test_train_step_benchmark_runs_flag_variants_on_one_model(data_dir, tmp_path, monkeypatch):
    from benchmarks import train_step

    builds, make_step = [], train_step.make_step

    def counted(cfg, world, compile_mode="default", built=None):
        out = make_step(cfg, world, compile_mode, built)
        builds.append((cfg.nonfinite, len(built)))
        return out

    monkeypatch.setattr(train_step, "make_step", counted)
    settings = {k: v for k, v in TINY_RUN.items() if k != "attn"}
    results = train_step.main(["--backends=checked:attn=naive,unchecked:attn=naive+nonfinite=off,sdpa", "--warmup=1",
                               "--rounds=1", "--steps=1", "--profile_steps=0", f"--out_dir={tmp_path}",
                               *cli_flags(**settings, data_dir=data_dir)])
    assert list(results["backends"]) == ["checked", "unchecked", "sdpa"]
    assert builds == [("skip", 1), ("off", 1), ("skip", 2)]  # nonfinite alone differs: the same model
