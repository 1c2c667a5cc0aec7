"""benchmarks/scaling.py, the multi-GPU runner, and benchmarks/scaling_report.py, its table: which runs a machine of N
GPUs gets and with which train.py flags, the report's arithmetic on hand-made run folders, the runner's loop with
train.py faked (time budget, a large model out of memory, the checkpoint handed to the resume run), and a CPU
rehearsal end to end (gloo, a tiny GPT, 2 processes: about 2 minutes here, most of it starting Python and torch)."""
import json
import math
import re
from pathlib import Path

import pytest
from helpers import cpu_env, run_cli, token_shards

from benchmarks import scaling, scaling_report


def test_a_machine_runs_ddp_at_one_then_every_power_of_two_and_its_own_count():
    assert scaling.gpu_counts(2) == [1, 2]
    assert scaling.gpu_counts(4) == [1, 2, 4]
    assert scaling.gpu_counts(8) == [1, 2, 4, 8]
    assert scaling.gpu_counts(6) == [1, 2, 4, 6]


def flags_of(cmd: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in cmd if arg.startswith("--") and "=" in arg)


def test_the_plan_of_four_gpus_keeps_the_global_batch_and_resumes_at_two(tmp_path):
    args = scaling.parse_args(["--gpus", "4", "--out_dir", str(tmp_path)])
    runs = scaling.plan(args)
    assert [r.name for r in runs] == ["ddp1", "single1", "ddp2", "ddp4", "fsdp4", "large-fsdp4", "resume-ddp2"]
    assert [(r.gpus, r.grad_accum) for r in runs] == [(1, 4), (1, 1), (2, 2), (4, 1), (4, 1), (4, 4), (2, 2)]
    commands = {r.name: scaling.command(r, tmp_path / r.name) for r in runs}
    for name, cmd in commands.items():
        flags = flags_of(cmd)
        # 16 x 1024 tokens per GPU at N=4; single1: one GPU's own 16 x 1024 a step
        assert flags["total_batch_size"] == str((1 if name == "single1" else 4) * 16 * 1024), name
        assert flags["attn"] == "triton" and flags["wandb"] == "false" and flags["eval_interval"] == "0", name
        assert flags["out_dir"] == str(tmp_path / name)
        assert ("torch.distributed.run" in cmd) == (name not in ("ddp1", "single1"))
        assert f"--nproc_per_node={dict((r.name, r.gpus) for r in runs)[name]}" in cmd or name in ("ddp1", "single1")
    assert flags_of(commands["ddp4"])["checkpoint_interval"] == "27"  # --steps 30, --resume_steps 3
    assert flags_of(commands["ddp4"])["final_checkpoint"] == "false"
    assert flags_of(commands["resume-ddp2"])["resume"] == "true" and runs[-1].from_step == 27
    large = flags_of(commands["large-fsdp4"])
    assert (large["n_layer"], large["n_embd"], large["n_head"], large["batch_size"]) == ("48", "2560", "20", "4")
    assert (large["parallel"], large["compile"], large["max_steps"]) == ("fsdp", "false", "10")
    assert flags_of(commands["fsdp4"])["compile"] == "true"
    two = scaling.plan(scaling.parse_args(["--gpus", "2", "--out_dir", str(tmp_path)]))
    # a resume needs N >= 4 unless asked
    assert [r.name for r in two] == ["ddp1", "single1", "ddp2", "fsdp2", "large-fsdp2"]
    assert "checkpoint_interval=0" in " ".join(scaling.command(two[2], tmp_path))
    assert all("ddp_reduce_dtype" not in flags_of(scaling.command(r, tmp_path)) for r in two)
    bf16 = scaling.plan(scaling.parse_args(["--gpus", "4", "--out_dir", str(tmp_path), "--ddp_reduce_dtype",
                                            "bfloat16"]))
    for run in bf16:  # DDP's runs only: --parallel=fsdp refuses it
        assert flags_of(scaling.command(run, tmp_path)).get("ddp_reduce_dtype") == (
            "bfloat16" if run.parallel == "ddp" else None), run.name


def test_micro_steps_accumulate_on_every_gpu_and_keep_the_one_gpu_runs_comparable(tmp_path):
    # --micro_steps 4 at 2 GPUs: each rank accumulates 4 micro-batches a step (DDP syncs on the last), the
    # accumulating GPU 8, single1 its own 4; the global batch grows with them
    runs = scaling.plan(scaling.parse_args(["--gpus", "2", "--out_dir", str(tmp_path), "--micro_steps", "4"]))
    assert [(r.name, r.gpus, r.grad_accum) for r in runs] == [
        ("ddp1", 1, 8), ("single1", 1, 4), ("ddp2", 2, 4), ("fsdp2", 2, 4), ("large-fsdp2", 2, 16)]
    for run in runs:
        tokens = int(flags_of(scaling.command(run, tmp_path))["total_batch_size"])
        assert tokens == (4 if run.name == "single1" else 8) * 16 * 1024, run.name
        assert tokens == run.grad_accum * run.gpus * run.batch_size * 1024, run.name  # train.py's accumulation
    with pytest.raises(SystemExit):
        scaling.parse_args(["--gpus", "2", "--micro_steps", "0"])
    ddp = scaling.plan(scaling.parse_args(["--gpus", "4", "--out_dir", str(tmp_path), "--ddp_only"]))
    assert [r.name for r in ddp] == ["ddp1", "single1", "ddp2", "ddp4", "resume-ddp2"]


def test_the_runner_refuses_fewer_than_two_gpus_and_a_resume_longer_than_half(capsys):
    with pytest.raises(SystemExit):
        scaling.parse_args(["--gpus", "1"])
    with pytest.raises(SystemExit):
        scaling.parse_args(["--gpus", "2", "--steps", "4", "--resume_steps", "3"])
    assert "--resume_steps must be from 1 to half of --steps (2)" in capsys.readouterr().err


def write_run(folder: Path, name: str, losses: list[float], tokens_per_s: list[float], first_step=0, peak=None,
              returncode=0, log="", **info):
    run = folder / name
    run.mkdir(parents=True)
    records = [{"step": first_step + i, "train_loss": loss, "tokens_per_s": tps, "step_ms": 1000.0, "mfu": None,
                "peak_mem_gb": peak, "warmup": i < 3} for i, (loss, tps) in enumerate(zip(losses, tokens_per_s))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "run.json").write_text(json.dumps({"name": name, "returncode": returncode, "timed_out": False,
                                              "wall_s": 10.0, **info}))
    (run / "train.log").write_text(log)


def plan_entry(name, kind, gpus, grad_accum, batch_size=16, **more):
    return {"name": name, "kind": kind, "gpus": gpus, "parallel": "fsdp" if "fsdp" in name else "ddp",
            "batch_size": batch_size, "grad_accum": grad_accum, "shape": "GPT-2 124M", "from_run": None,
            "from_step": None, **more}


def test_the_report_computes_efficiency_loss_differences_memory_and_the_resume(tmp_path):
    plan = {"env": {"gpu": "NVIDIA H100 80GB HBM3"}, "gpus": 4,
            "settings": {"model": "GPT-2 124M", "per_gpu": "16 x 1024 tokens", "global_batch": 65536},
            "runs": [plan_entry("ddp1", "ddp", 1, 4), plan_entry("single1", "single", 1, 1),
                     plan_entry("ddp2", "ddp", 2, 2), plan_entry("ddp4", "ddp", 4, 1),
                     plan_entry("fsdp4", "fsdp", 4, 1),
                     plan_entry("large-fsdp4", "large", 4, 8, batch_size=2, shape="n_layer 48"),
                     plan_entry("resume-ddp2", "resume", 2, 2, from_run="ddp4", from_step=4)]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    # 6 steps each; the first 3 are warmup, and --skip_steps 4 leaves steps 4 and 5 in the medians
    write_run(tmp_path, "ddp1", [5.0, 4.5, 4.0, 3.5, 3.0, 2.5], [1, 1, 1, 100, 200, 300], peak=20.0)
    write_run(tmp_path, "single1", [5.0, 4.6, 4.2, 3.8, 3.4, 3.0], [1, 1, 1, 1, 190, 210], peak=19.0)
    write_run(tmp_path, "ddp2", [5.0, 4.5, 4.01, 3.5, 3.02, 2.5], [1, 1, 1, 1, 380, 390], peak=21.0)
    write_run(tmp_path, "ddp4", [5.0, 4.49, 4.0, 3.5, 3.0, 2.46], [1, 1, 1, 1, 700, 740], peak=22.0)
    write_run(tmp_path, "fsdp4", [5.0, 4.49, 4.0, 3.5, 3.0, 2.47], [1, 1, 1, 1, 600, 620], peak=11.0)
    write_run(tmp_path, "large-fsdp4", [9.0, 8.0, 7.0, 6.5, 6.0, 5.5], [1, 1, 1, 1, 50, 70], peak=60.0,
              log="3838.6M parameters, attn=triton\n", out_of_memory_at=[4])
    write_run(tmp_path, "resume-ddp2", [3.0, 2.45], [1, 1], first_step=4)
    summary = scaling_report.write_report(tmp_path, skip_steps=4)

    rows = {row["gpus"]: row for row in summary["scaling"]}
    assert rows[1]["tokens_per_s"] == 250 and rows[2]["tokens_per_s"] == 385 and rows[4]["tokens_per_s"] == 720
    assert rows[2]["efficiency"] == pytest.approx(385 / (2 * 250)) and rows[4]["efficiency"] == pytest.approx(0.72)
    assert rows[1]["efficiency"] == 1 and rows[4]["tokens_per_s_per_gpu"] == 180
    # against one GPU's own step (single1, 200 tokens/s): the update no longer counts against the ranks
    assert rows[2]["efficiency_per_step"] == pytest.approx(385 / 400) and rows[4]["efficiency_per_step"] == 0.9
    assert rows[1]["efficiency_per_step"] is None
    assert rows[2]["loss_diff"] == pytest.approx({0: 0, 1: 0, 2: 0.01, 3: 0, 4: 0.02, 5: 0})
    assert rows[2]["max_abs_loss_diff"] == pytest.approx(0.02) and rows[2]["last_loss_diff"] == 0
    assert rows[4]["max_abs_loss_diff"] == pytest.approx(0.04) and rows[4]["last_loss_diff"] == pytest.approx(-0.04)
    assert [row["grad_accum"] for row in summary["scaling"]] == [4, 2, 1]
    fsdp = summary["fsdp"]
    assert fsdp["tokens_per_s_ratio"] == pytest.approx(610 / 720) and fsdp["memory_ratio"] == pytest.approx(0.5)
    assert fsdp["max_abs_loss_diff"] == pytest.approx(0.01)
    large = summary["large"]
    assert large["parameters"] == pytest.approx(3838.6e6) and large["ddp_state_gb"] == pytest.approx(16 * 3.8386)
    assert large["median_tokens_per_s"] == 60 and large["tokens_per_s_per_gpu"] == 15
    assert (large["batch_size"], large["grad_accum"], large["peak_mem_gb"]) == (2, 8, 60.0)
    resume = summary["resume"]
    assert (resume["written_on"], resume["resumed_on"], resume["from_step"]) == (4, 2, 4)
    assert resume["steps_compared"] == [4, 5] and resume["max_abs_loss_diff"] == pytest.approx(0.01)
    assert resume["status"] == "ok"

    md = (tmp_path / "results.md").read_text()
    assert md.startswith("# Scaling on 4 x NVIDIA H100 80GB HBM3")
    assert "| 4 | 1 | 720 | 180 | 0.72 | 0.9 | 0.04 | -0.04 | 22 | ok |" in md
    assert "1 GPU's own step (single1: one micro-batch a step, the update every step, as each DDP rank takes them): " \
           "200 tokens/s, ok." in md
    assert "| fsdp | 610 | 1000 | 11 | ok |" in md and "FSDP2 / DDP: tokens/s 0.847, peak memory 0.5" in md
    assert "| n_layer 48 | 3.84B | 2 x 8 | 60 | 15 | - | 60 | 61.4 | ok |" in md
    assert "A micro-batch of 4 ran out of memory first." in md
    assert "| 4 GPUs | 2 GPU(s) | 4 | 2 | 0.01 | ok |" in md
    assert "| 4 | 0.02 | 0 |" in md  # the step-by-step table: step 4, 2 GPUs and 4 GPUs minus 1 GPU
    assert json.loads((tmp_path / "results.json").read_text())["scaling"][1]["loss_diff"]["4"] == pytest.approx(0.02)

    # issue 51: the 4-GPU figures beside the 2-GPU session's results.json, each row naming its machine
    two = {"gpus": 2, "gpu": "NVIDIA H100 80GB HBM3",
           "large": {"median_tokens_per_s": 40.0, "tokens_per_s_per_gpu": 20.0, "peak_mem_gb": 70.0},
           "fsdp": {"runs": {"fsdp": {"median_tokens_per_s": 300.0, "peak_mem_gb": 15.0}}}}
    (tmp_path / "two.json").write_text(json.dumps(two))
    summary = scaling_report.write_report(tmp_path, skip_steps=4, against_path=tmp_path / "two.json")
    assert [row["large_tokens_per_s"] for row in summary["against"]["rows"]] == [40.0, 60]
    md = (tmp_path / "results.md").read_text()
    assert "| 2 x NVIDIA H100 80GB HBM3 | 40 | 20 | 70 | 300 | 15 |" in md
    assert "| 4 x NVIDIA H100 80GB HBM3 | 60 | 15 | 60 | 610 | 11 |" in md
    assert "against" not in scaling_report.write_report(tmp_path, 4, tmp_path / "missing.json")  # none: left out


def test_the_report_marks_runs_not_run_failed_timed_out_and_a_resume_that_started_afresh(tmp_path):
    plan = {"env": {"gpu": None}, "gpus": 2, "settings": {"model": "tiny", "per_gpu": "2 x 32", "global_batch": 128},
            "runs": [plan_entry("ddp1", "ddp", 1, 2), plan_entry("ddp2", "ddp", 2, 1),
                     plan_entry("fsdp2", "fsdp", 2, 1), plan_entry("large-fsdp2", "large", 2, 2),
                     plan_entry("resume-ddp1", "resume", 1, 2, from_run="ddp2", from_step=2)]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    write_run(tmp_path, "ddp1", [5.0, 4.0], [1, 1])
    write_run(tmp_path, "ddp2", [5.0, 4.0], [1, 1], returncode=1)
    write_run(tmp_path, "fsdp2", [], [], returncode=None, timed_out=True)
    write_run(tmp_path, "resume-ddp1", [5.0, 4.0], [1, 1])  # logged from step 0: it did not resume
    summary = scaling_report.summarize(tmp_path, skip_steps=0)
    statuses = {name: run["status"] for name, run in summary["runs"].items()}
    assert statuses == {"ddp1": "ok", "ddp2": "failed (exit 1)", "fsdp2": "timed out after 10 s",
                        "large-fsdp2": "not run", "resume-ddp1": "did not continue at step 2"}
    assert summary["scaling"][0]["tokens_per_s"] is None  # every step was warmup
    assert summary["scaling"][1]["efficiency"] is None
    assert "2 CPU processes (gloo): a rehearsal, not numbers" in scaling_report.markdown(summary)


def fake_train_py(oom_batches=()):
    """scaling.run_logged without train.py: writes the run's metrics (and, when asked for, its checkpoint) into its
    --out_dir; a large run with a micro-batch in oom_batches fails as CUDA would."""
    calls = []

    def run_logged(cmd, log_path, timeout, env):
        flags = flags_of(cmd)
        calls.append(flags)
        assert 0 < timeout <= 240  # what is left of --budget_s, at most --max_run_s
        out = Path(flags["out_dir"])
        if int(flags["batch_size"]) in oom_batches:
            log_path.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
            return 1, False
        first = 4 if flags.get("resume") == "true" else 0
        assert flags.get("resume") != "true" or (out / "ckpt.pt").read_text() == "step 4"
        if int(flags["checkpoint_interval"]):
            (out / "ckpt.pt").write_text(f"step {flags['checkpoint_interval']}")
        steps = range(first, int(flags["max_steps"]))
        (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train_loss": 5.0 - s, "tokens_per_s": 1e5,
                                                               "peak_mem_gb": 1.0, "warmup": False}) + "\n"
                                                   for s in steps))
        log_path.write_text("124.5M parameters\n")
        return 0, False

    return run_logged, calls


def test_the_runner_halves_a_large_micro_batch_that_ran_out_of_memory_and_hands_the_resume_its_checkpoint(
        tmp_path, monkeypatch):
    run_logged, calls = fake_train_py(oom_batches={4})
    monkeypatch.setattr(scaling, "run_logged", run_logged)
    assert scaling.main(["--gpus", "4", "--steps", "6", "--resume_steps", "2", "--out_dir", str(tmp_path)]) == 0
    assert [c["out_dir"].rsplit("/", 1)[1] for c in calls] == ["ddp1", "single1", "ddp2", "ddp4", "fsdp4",
                                                                "large-fsdp4", "large-fsdp4", "resume-ddp2"]
    assert (calls[5]["batch_size"], calls[6]["batch_size"]) == ("4", "2")
    summary = json.loads((tmp_path / "results.json").read_text())
    assert (summary["large"]["batch_size"], summary["large"]["grad_accum"]) == (2, 8)
    assert summary["large"]["out_of_memory_at"] == [4] and summary["large"]["status"] == "ok"
    assert (tmp_path / "large-fsdp4" / "train.oom-batch4.log").exists()
    assert summary["resume"]["status"] == "ok" and summary["resume"]["steps_compared"] == [4, 5]
    assert not list(tmp_path.glob("*/ckpt.pt"))  # the checkpoints served and were removed


def test_a_run_without_time_left_is_recorded_as_not_run(tmp_path, monkeypatch):
    run_logged, calls = fake_train_py()
    monkeypatch.setattr(scaling, "run_logged", run_logged)
    assert scaling.main(["--gpus", "2", "--budget_s", "0", "--out_dir", str(tmp_path)]) == 1
    assert calls == []
    summary = json.loads((tmp_path / "results.json").read_text())
    assert all(re.fullmatch(r"not run \(-?\d+ s left\)", run["status"]) for run in summary["runs"].values())


@pytest.mark.slow
def test_the_cpu_rehearsal_writes_every_row(tmp_path):
    data = token_shards(tmp_path / "data", 64, {"train": 20_000, "val": 4_000}, phrase=40, noise=0.1)
    out = tmp_path / "out"
    result = run_cli("-m", "benchmarks.scaling", "--tiny", "--gpus", "2", "--resume_check", "--steps", "4",
                     "--resume_steps", "2", "--large_steps", "4", "--skip_steps", "0", "--out_dir", str(out), "--",
                     f"--data_dir={data}", "--vocab_size=64", timeout=400, env=cpu_env(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "results.json").read_text())
    assert {name: run["status"] for name, run in summary["runs"].items()} == {
        name: "ok" for name in ("ddp1", "single1", "ddp2", "fsdp2", "large-fsdp2", "resume-ddp1")}
    one, two = summary["scaling"]
    assert (one["gpus"], one["grad_accum"], two["gpus"], two["grad_accum"]) == (1, 2, 2, 1)
    assert two["efficiency"] == pytest.approx(two["tokens_per_s"] / (2 * one["tokens_per_s"]))
    single = summary["runs"]["single1"]["median_tokens_per_s"]
    assert two["efficiency_per_step"] == pytest.approx(two["tokens_per_s"] / (2 * single))
    # fp32 on the CPU: 2 processes and 1 accumulating agree to rounding; so do FSDP2 and DDP, and the resumed run
    assert list(two["loss_diff"]) == ["0", "1", "2", "3"] and two["max_abs_loss_diff"] < 1e-5
    assert summary["fsdp"]["max_abs_loss_diff"] < 1e-5 and set(summary["fsdp"]["runs"]) == {"ddp", "fsdp"}
    assert summary["large"]["median_tokens_per_s"] > 0 and summary["large"]["parameters"] > 0
    assert summary["resume"]["steps_compared"] == [2, 3] and summary["resume"]["max_abs_loss_diff"] < 1e-5
    assert not list(out.glob("*/ckpt*.pt"))
    assert "resuming at step 2" in (out / "resume-ddp1" / "train.log").read_text()
    # the table is made from the files alone: redrawn, it is the same
    redrawn = scaling_report.summarize(out, skip_steps=0)
    assert json.loads(json.dumps(redrawn)) == summary
    assert all(math.isfinite(row["tokens_per_s"]) for row in summary["scaling"])
