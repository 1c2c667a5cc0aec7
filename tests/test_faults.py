"""Fault injection: seeded random damage to checkpoints and shards, kill -9 mid-run, NaN losses, out-of-range tokens,
each followed by a run of train.py, which must end in one of three ways:

- refused: a non-zero exit whose last stderr line starts with `train.py: error:` and names the damaged file(s), with
  no traceback anywhere in the output;
- fallback: the previous good checkpoint resumed (the message printed) and the run finished;
- finished: exit 0, the final checkpoint passes its check and holds only finite weights.

Never: exit 0 with a non-finite weight, or a non-finite train_loss in metrics.jsonl (train.py writes it as null) on a
step not marked skipped; never a lost good checkpoint (after every trial one of ckpt.pt / ckpt.prev.pt passes its
check, unless the trial damaged both). A damaged-checkpoint or kill -9 trial that finished, from the newest checkpoint
or the previous one, reproduces the uninterrupted run's losses bit for bit (a NaN trial: up to the NaN).

The trials are drawn from SEED: each has its own seed, from which it draws its damage (offset, length, bytes), its
step or its shard; a failing trial's id and message name its kind, seed and what it did. One tiny data folder, one
uninterrupted reference run per length and one trained checkpoint folder serve the whole module; each trial works on
copies. Everything runs in this process except the kill -9 trials, which need a process to kill.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, cli_flags, cpu_env, nan_loss_forward, read_metrics, run_main, token_shards

from model import GPT
from training.checkpoint import NAME, PREVIOUS, CheckpointError, read_checkpoint

SEED = 20251125
VOCAB = 64
# one layer, 32-token context, 2 sequences a step; dropout on, so a resume must restore the random streams too.
# Two shards per split (train 2 x 400 tokens, val 2 x 130): a resumed run opens the second train shard mid-run and
# every evaluation reads into the second val shard, so damage anywhere in the data is met by the runs below
SETTINGS = dict(n_layer=1, n_head=2, n_embd=32, block_size=32, vocab_size=VOCAB, batch_size=2, dropout=0.1,
                device="cpu", wandb=False, sample_interval=0, eval_interval=3, eval_iters=2, log_interval=1,
                checkpoint_interval=2, warmup_steps=1, learning_rate=1e-2, min_lr=1e-3, lr_decay_steps=8, seed=0)
TRAINED_STEPS = 4  # the trained folder: ckpt.prev.pt at step 2, ckpt.pt at step 4
STEPS = 8  # what the trials resume to
KILL_STEPS = 40  # what a killed run was to train, and its resumption does

TRIAL_COUNTS = {"newest": 16, "both": 10, "shard": 20, "tokens": 8, "nan": 10, "kill": 5}
ALLOWED = {  # the outcomes each kind may end in
    "newest": {"fallback", "finished"},  # finished: damage that changed nothing the checkpoint means (zip metadata)
    "both": {"refused", "fallback", "finished"},
    "shard": {"refused", "finished"},  # finished: bytes that still hold valid tokens
    "tokens": {"refused"},
    "nan": {"finished"},
    "kill": {"finished", "fallback"},  # fallback: killed between the two renames of a rotation
}
EXPECTED = {"newest": "fallback", "both": "refused", "shard": "refused", "tokens": "refused", "nan": "finished",
            "kill": "finished"}  # each kind's usual outcome: every kind must produce it at least once

rng = np.random.default_rng(SEED)
TRIALS = [(kind, i, int(rng.integers(2**31))) for kind, n in TRIAL_COUNTS.items() for i in range(n)]
OUTCOMES: list[tuple[str, int, int, str, str]] = []  # (kind, index, seed, outcome, what it did) of each trial run
del rng


def argv(out_dir, data_dir, **overrides) -> list[str]:
    return cli_flags(**{**SETTINGS, "out_dir": out_dir, "data_dir": data_dir, **overrides})


def comparable(records: list[dict]) -> list[dict]:
    """Records without what differs between equal runs: the timings, and the warm-up flag (per process)."""
    return [{k: v for k, v in r.items() if k not in ("step_ms", "tokens_per_s", "warmup")} for r in records]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("faults") / "data"
    token_shards(folder, VOCAB, {"train": 800, "val": 260}, phrase=40, noise=0.1, shards=2)
    return folder


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """max_steps -> (train records, val records) of an uninterrupted run, made on first use."""
    import train

    runs = {}

    def get(max_steps: int):
        if max_steps not in runs:
            out_dir = tmp_path_factory.mktemp("reference")
            train.main(argv(out_dir, data_dir, max_steps=max_steps))
            train_records, val_records = read_metrics(out_dir)
            runs[max_steps] = comparable(train_records), val_records
        return runs[max_steps]

    return get


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory) -> Path:
    """A run stopped at TRAINED_STEPS: ckpt.prev.pt at step 2, ckpt.pt at step 4, its metrics.jsonl."""
    import train

    out_dir = tmp_path_factory.mktemp("trained") / "run"
    train.main(argv(out_dir, data_dir, max_steps=TRAINED_STEPS))
    assert [read_checkpoint(str(out_dir / name))["step"] for name in (NAME, PREVIOUS)] == [4, 2]
    return out_dir


# --- damage ----------------------------------------------------------------------------------------------------------

def damage(path: Path, rng: np.random.Generator) -> str:
    """Overwrite a random span with random bytes, or truncate to a random length. -> what was done."""
    size = path.stat().st_size
    if rng.random() < 0.6:
        offset = int(rng.integers(0, size))
        length = int(min(rng.integers(1, 2 ** int(rng.integers(1, 13)) + 1), size - offset))
        data = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(data)
        return f"{path.name}: {length} random bytes at offset {offset} of {size} ({data[:8].hex()}...)"
    keep = int(rng.integers(0, size))
    os.truncate(path, keep)
    return f"{path.name}: truncated to {keep} of {size} bytes"


def out_of_range_tokens(path: Path, rng: np.random.Generator) -> str:
    """Token ids >= VOCAB written over 1 to 5 random tokens of a shard, its header and size untouched."""
    tokens = np.load(path, mmap_mode="r+")
    where = rng.choice(len(tokens), size=int(rng.integers(1, 6)), replace=False)
    values = rng.integers(VOCAB, 2**16, len(where))
    tokens[where] = values
    tokens.flush()
    del tokens
    return f"{path.name}: token ids {values.tolist()} at {sorted(where.tolist())}"


def last_logged_step(metrics: Path) -> int | None:
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # being written
            continue
        if "train_loss" in record:
            return record["step"]
    return None


# --- the trials ------------------------------------------------------------------------------------------------------

class Trial:
    """One trial's record: what it did, how its run ended, the checks on the result."""

    def __init__(self, kind: str, index: int, seed: int, out_dir: Path):
        self.kind, self.index, self.seed, self.out_dir = kind, index, seed, out_dir
        self.did: list[str] = []
        self.damaged: list[Path] = []  # the files whose names a refusal must carry
        self.status, self.out, self.err = None, "", ""

    def report(self, problem: str) -> str:
        tail = lambda text: text[-2500:] if len(text) > 2500 else text  # noqa: E731
        return (f"{self.kind} trial {self.index} (seed {self.seed}): {problem}\n  did: {'; '.join(self.did)}\n"
                f"  exit status: {self.status}\n  stdout:\n{tail(self.out)}\n  stderr:\n{tail(self.err)}")

    def check(self, condition, problem: str) -> None:
        if not condition:
            raise AssertionError(self.report(problem))

    def outcome(self) -> str:
        if "Traceback" in self.out + self.err:
            return "crashed"
        if self.status != 0:
            lines = self.err.strip().splitlines()
            last = lines[-1] if lines else ""
            if last.startswith("train.py: error:") and all(str(path) in last for path in self.damaged):
                return "refused"
            return "refused badly"
        return "fallback" if "resuming from the previous checkpoint" in self.out else "finished"

    def checkpoint(self, name: str) -> dict | None:
        try:
            return read_checkpoint(str(self.out_dir / name))
        except CheckpointError:
            return None


def run_trial(kind, index, seed, tmp_path, data_dir, trained, capsys, monkeypatch) -> Trial:
    """Damage a copy of the trained folder (or of the data), then resume it to STEPS in this process; or kill a run
    and resume it."""
    rng = np.random.default_rng(seed)
    out_dir = tmp_path / "run"
    trial = Trial(kind, index, seed, out_dir)
    if kind == "kill":
        run_kill_trial(trial, rng, data_dir, capsys)
        return trial
    shutil.copytree(trained, out_dir)
    if kind in ("shard", "tokens"):
        data_dir = shutil.copytree(data_dir, tmp_path / "data")
        shard = data_dir / str(rng.choice(sorted(p.name for p in data_dir.glob("*.npy"))))
        trial.did.append(damage(shard, rng) if kind == "shard" else out_of_range_tokens(shard, rng))
        trial.damaged = [shard]
    elif kind in ("newest", "both"):
        trial.damaged = [out_dir / NAME] + ([out_dir / PREVIOUS] if kind == "both" else [])
        trial.did += [damage(path, rng) for path in trial.damaged]
    elif kind == "nan":
        call, keep_grad = int(rng.integers(0, STEPS - TRAINED_STEPS)), bool(rng.random() < 0.5)
        monkeypatch.setattr(GPT, "forward", nan_loss_forward(GPT.forward, {call}, keep_grad=keep_grad))
        trial.did.append(f"NaN loss at step {TRAINED_STEPS + call} ({'loss only' if keep_grad else 'and gradients'})")
    trial.status, trial.out, trial.err = run_main(argv(out_dir, data_dir, max_steps=STEPS, resume=True), capsys)
    return trial


def run_kill_trial(trial: Trial, rng, data_dir, capsys) -> None:
    """python train.py, SIGKILL once it has logged a random step (plus a random few ms, to land anywhere in a step or a
    checkpoint write), then --resume in this process to the end."""
    out_dir = trial.out_dir
    interval = int(rng.integers(1, 4))
    # at least 16 steps (and 5 checkpoints) left after the target: the kill lands before the run ends
    target, delay = int(rng.integers(interval, KILL_STEPS - 16)), float(rng.uniform(0, 0.02))
    flags = argv(out_dir, data_dir, max_steps=KILL_STEPS, checkpoint_interval=interval)
    with open(out_dir.parent / "killed.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "train.py", *flags], cwd=ROOT, env=cpu_env(), stdout=log,
                                stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while (last_logged_step(out_dir / "metrics.jsonl") or -1) < target and proc.poll() is None:
            if time.time() > deadline:
                proc.kill()
                raise AssertionError(trial.report(f"the run to kill never logged step {target}"))
            time.sleep(0.003)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        killed_status = proc.wait()
    killed_output = (out_dir.parent / "killed.log").read_text()
    trial.did.append(f"checkpoint_interval={interval}, SIGKILL {1000 * delay:.0f} ms after step {target} was logged: "
                     f"exit status {killed_status}, last step logged {last_logged_step(out_dir / 'metrics.jsonl')}, "
                     f"files {sorted(p.name for p in out_dir.iterdir())}")
    trial.check(killed_status == -signal.SIGKILL, f"the run to kill ended on its own:\n{killed_output[-2500:]}")
    trial.status, trial.out, trial.err = run_main(
        argv(out_dir, data_dir, max_steps=KILL_STEPS, checkpoint_interval=interval, resume=True), capsys)


@pytest.mark.parametrize("kind, index, seed", TRIALS, ids=[f"{kind}-{index:02d}" for kind, index, _ in TRIALS])
def test_fault(kind, index, seed, tmp_path, data_dir, trained, reference, capsys, monkeypatch):
    trial = run_trial(kind, index, seed, tmp_path, data_dir, trained, capsys, monkeypatch)
    outcome = trial.outcome()
    OUTCOMES.append((kind, index, seed, outcome, "; ".join(trial.did)))
    trial.check(outcome in ALLOWED[kind], f"ended {outcome}, allowed: {', '.join(sorted(ALLOWED[kind]))}")

    # never a lost good checkpoint
    if kind != "both":
        trial.check(trial.checkpoint(NAME) or trial.checkpoint(PREVIOUS), "neither checkpoint passes its check")
    if outcome in ("finished", "fallback"):
        # nothing non-finite in a finished run: the weights saved, and the losses of steps that were not skipped
        final = trial.checkpoint(NAME)
        max_steps = KILL_STEPS if kind == "kill" else STEPS
        trial.check(final is not None and final["step"] == max_steps, f"the final checkpoint is not step {max_steps}")
        trial.check(all(torch.isfinite(w).all() for w in final["model"].values()), "non-finite weights were saved")
        records, vals = read_metrics(trial.out_dir)
        trial.check([r["step"] for r in records] == list(range(max_steps)), "metrics.jsonl is not one unbroken curve")
        trial.check(all(r["skipped"] or (r["train_loss"] is not None and np.isfinite(r["train_loss"]))
                        for r in records), "a non-finite train_loss (written as null) on a step not marked skipped")
        trial.check(not list(trial.out_dir.glob("*.tmp")), "a temporary checkpoint file was left behind")
        if kind == "nan":
            skipped = [r["step"] for r in records if r["skipped"]]
            trial.check(len(skipped) == 1 and final["skipped_steps"] == 1 and records[-1]["skipped_steps"] == 1,
                        f"skipped steps {skipped}, the checkpoint counts {final['skipped_steps']}, expected one")
            trial.check(comparable(records[:skipped[0]]) == reference(STEPS)[0][:skipped[0]],
                        "the steps before the NaN differ from the uninterrupted run")
        elif kind != "shard":  # shards with valid tokens changed train on other data
            trial.check(comparable(records) == reference(max_steps)[0] and vals == reference(max_steps)[1],
                        "the losses differ from the uninterrupted run's")
    if kind == "both" and outcome == "refused":  # a refusal leaves the files as they were, for the user to salvage
        trial.check((trial.out_dir / NAME).exists() and (trial.out_dir / PREVIOUS).exists(), "a checkpoint was removed")
    if outcome == "fallback":
        trial.check(f"resuming from the previous checkpoint {trial.out_dir / PREVIOUS}" in trial.out,
                    "the fallback message does not name the previous checkpoint")


def test_fault_summary():
    """Runs after the trials (pytest keeps a module's order): every kind ran and ended only in allowed ways."""
    if len(OUTCOMES) < len(TRIALS):
        pytest.skip("the summary needs every trial of this module to have run")
    outcomes = defaultdict(Counter)
    for kind, _, _, outcome, _ in OUTCOMES:
        outcomes[kind][outcome] += 1
    lines = [f"fault trials (seed {SEED}): {len(OUTCOMES)}"] + [
        f"  {kind:7} {sum(counts.values()):3}: " + ", ".join(f"{o} {n}" for o, n in sorted(counts.items()))
        for kind, counts in outcomes.items()]
    print("\n".join(f"{kind}-{index:02d} (seed {seed}): {outcome}: {did}" for kind, index, seed, outcome, did in OUTCOMES))
    print("\n".join(lines))
    assert len(OUTCOMES) >= 50 and {kind: sum(c.values()) for kind, c in outcomes.items()} == TRIAL_COUNTS
    bad = [(kind, index, seed, outcome) for kind, index, seed, outcome, _ in OUTCOMES if outcome not in ALLOWED[kind]]
    assert not bad, f"trials in a forbidden state: {bad}\n" + "\n".join(lines)
    missing = [kind for kind, expected in EXPECTED.items() if not outcomes[kind][expected]]
    assert not missing, f"kinds that never ended as they usually do: {missing}\n" + "\n".join(lines)
