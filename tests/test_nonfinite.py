"""Non-finite steps in train.py: a NaN loss or gradient skips the update, on every rank alike, and is logged and
counted; steps in a row stop the run without saving; --nonfinite=off lets the NaN through and only the save refuses
it; TrainStep refuses an optimizer that cannot skip on the device."""
import math
from contextlib import nullcontext

import numpy as np
import pytest
import torch
from helpers import TINY_VOCAB, TRAIN_PY_KEYS, nan_loss_forward, read_metrics, run_main, tiny_argv, tiny_config

import train
from model import GPT
from training.checkpoint import Checkpoints, read_checkpoint


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
    status, out, err = run_main(tiny_argv(tmp_path, data_dir, max_steps=5, checkpoint_interval=1, log_interval=3),
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
    argv = tiny_argv(tmp_path, data_dir, max_steps=10, checkpoint_interval=2, nonfinite=nonfinite,
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
    status, out, err = run_main(tiny_argv(tmp_path, data_dir, max_steps=7, max_skipped_steps=2, log_interval=100),
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
    status, out, err = run_main(tiny_argv(tmp_path, data_dir, max_steps=6, checkpoint_interval=2, nonfinite="off"),
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
    status, out, err = run_main(tiny_argv(tmp_path, data_dir, max_steps=3, nonfinite=nonfinite), capsys)
    assert status == 1 and err.splitlines()[-1].startswith("train.py: error: ") and "Traceback" not in err
    assert not (tmp_path / "ckpt.pt").exists() and not (tmp_path / "ckpt.prev.pt").exists()
    assert f"{tmp_path / 'ckpt.pt'} is the last good checkpoint" not in err and "--resume" not in err, err


def tiny_train_step(tmp_path, data_dir, check_finite: bool, scaler: bool = False):
    from training.step import TrainStep

    torch.manual_seed(0)
    model = GPT(tiny_config(tmp_path, data_dir).gpt_config())
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
    loader = train.open_loader(tiny_config(tmp_path, data_dir), "train", train.World(), TINY_VOCAB)
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
