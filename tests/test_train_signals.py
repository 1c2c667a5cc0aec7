"""train.py stopped: SIGTERM mid-run saves a loadable checkpoint and stops at once wherever the run is; a signal
during the set-up, or a second one, ends the run in one line; final_checkpoint=false keeps the periodic checkpoints
only. The tiny run and its data: helpers.tiny_config, conftest's data_dir."""
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, TINY_RUN, cli_flags, cpu_env, read_metrics, run_cli, run_main, tiny_argv

import train
from training.checkpoint import read_checkpoint


def test_final_checkpoint_false_writes_none_at_the_end_but_keeps_the_periodic_ones(tmp_path, data_dir, capsys):
    # timing runs (benchmarks/scaling.py) leave out the end's checkpoint: a large model's takes minutes to write
    status, out, err = run_main(tiny_argv(tmp_path / "none", data_dir, max_steps=3, final_checkpoint=False), capsys)
    assert status == 0, err
    assert not (tmp_path / "none" / "ckpt.pt").exists() and len(read_metrics(tmp_path / "none")[0]) == 3
    assert "done at step 3; no final checkpoint (final_checkpoint=false)" in out
    status, _, err = run_main(tiny_argv(tmp_path / "periodic", data_dir, max_steps=3, checkpoint_interval=2,
                                        final_checkpoint=False), capsys)
    assert status == 0, err
    assert read_checkpoint(tmp_path / "periodic" / "ckpt.pt")["step"] == 2


def test_sigterm_mid_run_saves_a_loadable_checkpoint(tmp_path, data_dir):
    flags = cli_flags(**{**TINY_RUN, "max_steps": 100_000, "data_dir": data_dir, "out_dir": tmp_path})
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
    flags = cli_flags(**{**TINY_RUN, "max_steps": 100_000, "data_dir": data_dir, "out_dir": tmp_path, **settings})
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
    status, out, err = run_main(tiny_argv(tmp_path / "run", data_dir, max_steps=2), capsys)
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
