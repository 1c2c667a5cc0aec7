"""train.py on 2 CPU processes (torchrun, gloo) under --parallel=ddp and --parallel=fsdp (FSDP2): the same losses,
checkpoints that resume on another number of processes and under the other strategy, a killed rank ending the job in
seconds and a hung one after --dist_timeout, each with one line; bad settings in one line. Each torchrun job takes
about 10 s, most of it starting Python and torch in three processes (torchrun's agent and two ranks)."""
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from helpers import ROOT, TINY_RUN, cli_flags, cpu_env, read_metrics, run_cli, run_main

import train
from training.checkpoint import read_checkpoint
from training.config import ConfigError, TrainConfig

# the tiny run (helpers.TINY_RUN, on conftest's data_dir); every test passes its own batch, steps and out_dir
TINY = {k: v for k, v in TINY_RUN.items() if k != "batch_size"}


def torchrun(parallel: str, timeout=120, **settings) -> subprocess.CompletedProcess:
    """train.py on 2 processes; any failure fails the test with the end of their output."""
    result = run_cli("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                     *cli_flags(**{**TINY, **settings, "parallel": parallel}), timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def losses(out_dir) -> list[float]:
    return [r["train_loss"] for r in read_metrics(out_dir)[0]]


# 2 ranks x 2 micro-steps of 1 sequence: the gradient sync waits for the last micro-step under both strategies.
# Samples run the sharded model's forward on every rank (a collective), and checkpoints gather its shards
SAME_BATCHES = dict(max_steps=4, batch_size=1, total_batch_size=4 * 16, eval_interval=2, eval_iters=2,
                    sample_interval=4, sample_tokens=4, sample_prompt="!", checkpoint_interval=2)


@pytest.fixture(scope="module")
def both_runs(data_dir, tmp_path_factory) -> dict:
    """out_dir of a 4-step run under each strategy, on 2 processes, from the same initial weights."""
    folder = tmp_path_factory.mktemp("both")
    for parallel in ("ddp", "fsdp"):
        torchrun(parallel, data_dir=data_dir, out_dir=folder / parallel, **SAME_BATCHES)
    return {parallel: folder / parallel for parallel in ("ddp", "fsdp")}


def test_ddp_and_fsdp_give_the_same_losses(both_runs):
    (ddp, ddp_val), (fsdp, fsdp_val) = read_metrics(both_runs["ddp"]), read_metrics(both_runs["fsdp"])
    assert [r["step"] for r in fsdp] == [0, 1, 2, 3]
    np.testing.assert_allclose([r["train_loss"] for r in fsdp], [r["train_loss"] for r in ddp], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in fsdp], [r["grad_norm"] for r in ddp], rtol=1e-5)
    np.testing.assert_allclose([v["val_loss"] for v in fsdp_val], [v["val_loss"] for v in ddp_val], rtol=1e-5)
    assert (both_runs["fsdp"] / "samples.txt").read_text().count("step 4") == 1  # rank 0 alone writes it
    ddp_ckpt, fsdp_ckpt = (read_checkpoint(both_runs[parallel] / "ckpt.pt") for parallel in ("ddp", "fsdp"))
    assert fsdp_ckpt["model"].keys() == ddp_ckpt["model"].keys()  # one format: whole tensors, no prefixes
    assert fsdp_ckpt["optimizer"]["param_groups"] == ddp_ckpt["optimizer"]["param_groups"]
    for key, weight in fsdp_ckpt["model"].items():
        np.testing.assert_allclose(weight.numpy(), ddp_ckpt["model"][key].numpy(), rtol=1e-4, atol=1e-6)


def test_a_ddp_checkpoint_resumes_under_fsdp(both_runs, data_dir, tmp_path):
    # the same two steps from DDP's checkpoint under FSDP2 on 2 processes and from FSDP2's on 1 process
    for parallel in ("ddp", "fsdp"):  # copies: the runs stay as the other tests read them
        shutil.copytree(both_runs[parallel], tmp_path / parallel)
    resumed = {**SAME_BATCHES, "data_dir": data_dir, "max_steps": 6, "resume": True}
    torchrun("fsdp", out_dir=tmp_path / "ddp", **resumed)
    train.train(TrainConfig(**{**TINY, **resumed, "out_dir": str(tmp_path / "fsdp")}))
    assert [r["step"] for r in read_metrics(tmp_path / "ddp")[0]] == list(range(6))
    np.testing.assert_allclose(losses(tmp_path / "ddp")[4:], losses(tmp_path / "fsdp")[4:], rtol=1e-5)


def test_an_fsdp_checkpoint_resumes_on_one_process_then_on_two_under_ddp(tmp_path, data_dir):
    # one run of 6 steps of 4 sequences, against the same steps in three parts: FSDP2 on 2 processes, 1 process,
    # DDP on 2. Each part continues the step, the data position, the weights and AdamW's moments
    out_dir = tmp_path / "parts"
    per_rank = dict(data_dir=data_dir, out_dir=str(out_dir), batch_size=2, lr_decay_steps=6)
    torchrun("fsdp", max_steps=2, **per_rank)
    assert read_checkpoint(out_dir / "ckpt.pt")["step"] == 2
    train.train(TrainConfig(**{**TINY, **per_rank, "batch_size": 4, "max_steps": 4, "resume": True}))
    assert read_checkpoint(out_dir / "ckpt.pt")["step"] == 4
    resumed = torchrun("ddp", max_steps=6, resume=True, **per_rank)
    assert "resuming at step 4" in resumed.stdout
    assert read_checkpoint(out_dir / "ckpt.pt")["step"] == 6
    train.train(TrainConfig(**{**TINY, "data_dir": data_dir, "out_dir": str(tmp_path / "whole"), "batch_size": 4,
                               "max_steps": 6}))
    assert [r["step"] for r in read_metrics(out_dir)[0]] == list(range(6))
    np.testing.assert_allclose(losses(out_dir), losses(tmp_path / "whole"), rtol=1e-4)


@contextmanager
def job_with_a_checkpoint(tmp_path, data_dir, **settings):
    """A 2-process FSDP2 job of 10,000 steps once it has written its first checkpoint (step 5).
    -> (the torchrun process, the process id of each rank, the log of the job's output); killed if left running."""
    script = tmp_path / "noting_pid.py"  # each rank notes its process id, so that a test can signal one alone
    pid_file = f"os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK'])"
    script.write_text(f"import os, sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                      f"open({pid_file}, 'w').write(str(os.getpid()))\nimport train\ntrain.main(sys.argv[1:])\n")
    out_dir, log = tmp_path / "run", tmp_path / "job.log"
    flags = cli_flags(**{**TINY, "data_dir": data_dir, "out_dir": out_dir, "batch_size": 2, "max_steps": 10_000,
                         "checkpoint_interval": 5, "parallel": "fsdp", **settings})
    with open(log, "w") as output:
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                str(script), *flags], cwd=ROOT, env=cpu_env(), stdout=output, stderr=subprocess.STDOUT)
    pids = []
    try:
        wait_for(lambda: (out_dir / "ckpt.pt").exists() or job.poll() is not None, 90)
        assert job.poll() is None and (out_dir / "ckpt.pt").exists(), log.read_text()[-3000:]
        pids = [int((tmp_path / f"rank{rank}").read_text()) for rank in (0, 1)]
        yield job, pids, log
    finally:
        if job.poll() is None:
            job.kill()
        for pid in pids:  # a test that failed midway leaves no rank behind, least of all a stopped one
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break


def wait_for(condition, timeout: float) -> float:
    """Poll condition() until it holds or timeout seconds pass. -> the seconds waited."""
    start = time.monotonic()
    while not condition() and time.monotonic() - start < timeout:
        time.sleep(0.1)
    return time.monotonic() - start


def lost_contact_lines(output: str) -> list[str]:
    assert "]: Traceback" not in output  # torchrun prefixes a worker's lines with [rankN]: (its own report is last)
    return [line for line in output.splitlines() if line.startswith("train.py: error: lost contact")]


def test_a_killed_rank_ends_the_job_in_seconds_and_resume_continues(tmp_path, data_dir):
    with job_with_a_checkpoint(tmp_path, data_dir) as (job, pids, log):
        os.kill(pids[1], signal.SIGKILL)
        took = wait_for(lambda: job.poll() is not None, 60)
    assert job.returncode != 0 and took < 20, f"{took:.1f} s\n{log.read_text()[-3000:]}"
    lost_contact_lines(log.read_text())  # rank 0 leaves in one line, or torchrun ends it first
    out_dir = tmp_path / "run"
    resumed_from = read_checkpoint(out_dir / "ckpt.pt")["step"]
    assert resumed_from >= 5 and resumed_from % 5 == 0
    train.train(TrainConfig(**{**TINY, "data_dir": data_dir, "out_dir": str(out_dir), "batch_size": 4,
                               "max_steps": resumed_from + 2, "lr_decay_steps": 10_000, "resume": True}))
    assert read_checkpoint(out_dir / "ckpt.pt")["step"] == resumed_from + 2


def test_a_hung_rank_ends_the_others_after_dist_timeout_in_one_line(tmp_path, data_dir):
    with job_with_a_checkpoint(tmp_path, data_dir, dist_timeout=5) as (job, pids, log):
        os.kill(pids[1], signal.SIGSTOP)  # alive, but answering nothing
        took = wait_for(lambda: "Timed out" in log.read_text(), 30)
        os.kill(pids[1], signal.SIGCONT)  # torchrun's SIGTERM, pending while it was stopped, ends it
        wait_for(lambda: job.poll() is not None, 30)
    assert took < 20 and job.returncode != 0, f"{took:.1f} s\n{log.read_text()[-3000:]}"
    first = lost_contact_lines(log.read_text())[0]
    assert "Timed out waiting 5000ms" in first and first.endswith("then continue with --resume")


def test_a_collectives_failure_is_one_line():
    from training.distributed import lost_contact

    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:42921: Connection "
                        "reset by peer. This is typically caused by a remote worker hanging. GLHF!")
    assert str(lost_contact(gloo)).startswith("lost contact with the other processes ([third_party/gloo/gloo/"
                                              "transport/tcp/pair.cc:537] Read error [127.0.0.1]:42921: Connection "
                                              "reset by peer): a rank died, or hung past --dist_timeout;")
    assert lost_contact(RuntimeError("shape mismatch")) is None  # a bug keeps its traceback


def test_bad_parallel_settings_are_one_line(tmp_path, data_dir, capsys):
    result = run_cli("train.py", "--parallel=zero", "--device=cpu", timeout=60)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == ["train.py: error: unknown parallel='zero'; choose one of: ddp, fsdp"]
    with pytest.raises(ConfigError, match="dist_timeout must be at least 1"):
        TrainConfig(dist_timeout=0)
    status, _, err = run_main(["--parallel=fsdp", "--dtype=float16", *cli_flags(**{**TINY, "data_dir": data_dir,
                                                                                    "out_dir": tmp_path / "run"})],
                              capsys)
    assert status == 1 and err.strip().splitlines() == [
        "train.py: error: parallel=fsdp does not train in float16 (its loss scaler sees one shard); pass "
        "--dtype=bfloat16 or --dtype=float32, or --parallel=ddp"]


@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_ddp_reduces_gradients_in_the_dtype_asked_for(reduce_dtype):
    # one process in a gloo group of one: the all-reduce's mean is the rank's own gradient, rounded to bf16 on the
    # way with --ddp_reduce_dtype=bfloat16, untouched in float32
    import torch.distributed as dist

    from training.distributed import data_parallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    model(x).square().sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = data_parallel(model, torch.device("cpu"), bucket_mb=1, reduce_dtype=reduce_dtype)
        ddp(x).square().sum().backward()
        reduced = [p.grad for p in model.parameters()]
    finally:
        dist.destroy_process_group()
    for got, want in zip(reduced, plain):
        assert got.dtype == torch.float32
        expected = want.to(torch.bfloat16).float() if reduce_dtype == "bfloat16" else want
        assert torch.equal(got, expected)
    if reduce_dtype == "bfloat16":
        assert any(not torch.equal(got, want) for got, want in zip(reduced, plain))  # the rounding is real
