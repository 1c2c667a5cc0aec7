"""benchmarks/compare.py and compare_report.py on the CPU: the training comparison's analysis on synthetic metrics
(loss differences, steady medians, speed-ups, skipped steps, gzipped metrics, figures), its variants and command lines,
and one real comparison of train.py; the launch timeline and the documents benchmark."""
import gzip
import json
import re
from pathlib import Path

import pytest
import torch
from helpers import ROOT, markdown_section, qkv, token_shards

from benchmarks import compare, compare_report, report
from benchmarks.report import fmt


def write_run(folder: Path, losses, step_ms, val=None, returncode=0, repeat_step=None, **meta):
    folder.mkdir(parents=True)
    lines = []
    for step, (loss, ms) in enumerate(zip(losses, step_ms)):
        lines.append({"step": step, "train_loss": loss, "lr": 1e-3, "grad_norm": 1.0, "step_ms": ms,
                      "tokens_per_s": 1000.0 / ms, "mfu": None, "peak_mem_gb": None, "attn": folder.name,
                      "warmup": step == 0})
    if repeat_step is not None:  # a stale record of a step logged again later (a resume): the later one counts
        lines.insert(repeat_step, {**lines[repeat_step], "train_loss": 99.0})
    for step, loss in (val or {}).items():
        lines.append({"step": step, "val_loss": loss, "attn": folder.name})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "run.json").write_text(json.dumps({"variant": folder.name, "group": "g", "train_args": ["c.py"],
                                                 "returncode": returncode, "env": {"torch": "2.13"}, **meta}))


def test_comparison_reports_loss_diffs_steady_medians_and_speedups(tmp_path):
    write_run(tmp_path / "sdpa", [5.0, 4.0, 3.0, 2.5, 2.0], [900, 100, 100, 110, 90], val={2: 2.05, 4: 2.10})
    write_run(tmp_path / "triton", [5.0, 4.01, 2.97, 2.52, 2.0], [2000, 50, 50, 60, 40], val={4: 2.15}, repeat_step=2)
    write_run(tmp_path / "naive", [5.0, 4.0, 3.0, 2.5, 2.0], [800, 200, 200, 220, 180])
    (tmp_path / "compile").mkdir()
    (tmp_path / "compile" / "run.json").write_text(json.dumps({"returncode": 1}))

    summary = compare_report.write_report(tmp_path, reference="sdpa", skip_steps=0)
    b = summary["backends"]
    assert list(b) == ["compile", "naive", "sdpa", "triton"]
    assert b["triton"]["max_abs_train_diff"] == pytest.approx(0.03)
    assert b["triton"]["max_abs_val_diff"] == pytest.approx(0.05)
    assert b["naive"]["max_abs_train_diff"] == 0.0 and b["naive"]["max_abs_val_diff"] is None
    # step 0, flagged warm-up by train.py, is dropped: medians of the 4 later steps
    assert b["triton"]["median_step_ms"] == 50 and b["sdpa"]["median_step_ms"] == 100 and b["naive"]["median_step_ms"] == 200
    assert b["triton"]["speedup_vs_naive"] == 4.0 and b["sdpa"]["speedup_vs_naive"] == 2.0
    assert b["triton"]["speedup_vs_reference"] == 2.0 and b["naive"]["speedup_vs_reference"] == 0.5
    assert b["sdpa"]["final_val_loss"] == 2.10 and b["sdpa"]["min_val_loss"] == 2.05
    assert b["triton"]["median_tokens_per_s"] == 20.0 and b["triton"]["median_mfu"] is None
    assert b["compile"]["status"].startswith("failed: train.py exited with 1") and b["compile"]["median_step_ms"] is None

    assert b["triton"]["timed_steps"] == 4
    assert summary["warnings"] == []  # every run.json has the same train.py arguments
    assert compare_report.summarize(compare_report.load_runs(tmp_path), "sdpa", skip_steps=3)["backends"]["triton"]["timed_steps"] == 2

    assert json.loads((tmp_path / "comparison.json").read_text()) == summary
    meta = json.loads((tmp_path / "naive" / "run.json").read_text())
    (tmp_path / "naive" / "run.json").write_text(json.dumps({**meta, "train_args": ["c.py", "--max_steps=9"]}))
    assert "different train.py arguments" in compare_report.summarize(compare_report.load_runs(tmp_path), "sdpa", 0)["warnings"][0]
    assert (tmp_path / "loss.png").stat().st_size > 0
    header, rows = markdown_section((tmp_path / "comparison.md").read_text(), "Per run")
    assert "MFU %" not in header and "flags" not in header  # no run has a value for them
    for row in rows:
        for column, text in zip(header[1:], row[1:]):
            key, scale = next((key, scale) for h, key, scale in compare_report.COLUMNS + [("status", "status", None)] if h == column)
            value = b[row[0]][key]
            assert text == (value if scale is None else fmt(value * scale if value is not None else None)), (row[0], column)


def test_report_keeps_the_order_runs_were_made_in_and_their_flags(tmp_path):
    for index, name in enumerate(["dense", "window", "moba"], 1):
        write_run(tmp_path / name, [5.0, 4.0, 3.0], [100, 100 / index, 100 / index], val={2: 3.0 + index},
                  index=index, settings={"attn": "triton", **({"window": "256"} if name == "window" else {})})
    summary = compare_report.write_report(tmp_path, skip_steps=0)  # no sdpa run: the first is the reference
    assert summary["reference"] == "dense" and list(summary["backends"]) == ["dense", "window", "moba"]
    assert summary["backends"]["moba"]["speedup_vs_reference"] == 3.0
    assert summary["backends"]["window"]["max_abs_val_diff"] == 1.0
    header, rows = markdown_section((tmp_path / "comparison.md").read_text(), "Per run")
    assert header[:2] == ["run", "flags"] and "speed-up vs naive" not in header
    assert [row[:2] for row in rows] == [["dense", "--attn=triton"], ["window", "--attn=triton --window=256"],
                                         ["moba", "--attn=triton"]]


def test_comparison_leaves_skipped_steps_out_of_the_curves_and_counts_them(tmp_path):
    write_run(tmp_path / "sdpa", [5.0, 4.0, 3.0, 2.5], [100, 100, 100, 100])
    write_run(tmp_path / "triton", [5.0, 4.0, 3.0, 2.5], [100, 100, 100, 100])
    # train.py's records: step 1 skipped for a NaN loss, written as null, and counted from there on
    metrics = tmp_path / "triton" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    for r in records:
        r.update(skipped=r["step"] == 1, skipped_steps=int(r["step"] >= 1))
    records[1].update(train_loss=None, grad_norm=None)
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = compare_report.write_report(tmp_path, reference="sdpa", skip_steps=0)
    b = summary["backends"]
    assert b["triton"]["skipped_steps"] == 1 and b["sdpa"]["skipped_steps"] is None
    assert b["triton"]["max_abs_train_diff"] == 0.0 and b["triton"]["last_step"] == 3
    header, rows = markdown_section((tmp_path / "comparison.md").read_text(), "Per run")
    assert dict(zip(header, next(row for row in rows if row[0] == "triton")))["skipped steps"] == "1"


def test_a_run_with_gzipped_metrics_reports_as_the_plain_one(tmp_path):
    write_run(tmp_path / "sdpa", [5.0, 4.0, 3.0], [100, 100, 100], val={2: 3.1})
    write_run(tmp_path / "triton", [5.0, 4.1, 2.9], [100, 50, 50], val={2: 3.2})
    plain = compare_report.summarize(compare_report.load_runs(tmp_path), "sdpa", skip_steps=0)
    metrics = tmp_path / "triton" / "metrics.jsonl"
    metrics.with_suffix(".jsonl.gz").write_bytes(gzip.compress(metrics.read_bytes()))
    metrics.unlink()
    (tmp_path / "triton" / "run.json").unlink()  # found by its metrics alone
    gzipped = compare_report.summarize(compare_report.load_runs(tmp_path), "sdpa", skip_steps=0)
    assert gzipped["backends"]["triton"] == plain["backends"]["triton"]
    assert gzipped["backends"]["triton"]["max_abs_train_diff"] == pytest.approx(0.1)


@pytest.mark.parametrize("folder", ["same_loss/fp32", "same_loss/bf16", "long_context/T4096", "long_context/T8192"])
def test_the_committed_comparisons_come_from_their_gzipped_metrics(folder):
    results = ROOT / "benchmarks" / "results" / folder
    committed = json.loads((results / "comparison.json").read_text())
    assert all((results / run / "metrics.jsonl.gz").exists() for run in committed["backends"])
    runs = compare_report.load_runs(results)
    assert compare_report.summarize(runs, committed["reference"], committed["skip_steps"]) == committed


def test_thin_keeps_every_kth_point_and_the_last():
    xs = list(range(1201))
    ys = [x * 0.5 for x in xs]
    thin_xs, thin_ys = report.thin(xs, ys, most=500)
    assert len(thin_xs) <= 501 and thin_xs[0] == 0 and thin_xs[-1] == 1200 and thin_xs[1] == 3
    assert thin_ys == [x * 0.5 for x in thin_xs]
    assert report.thin(xs[:500], ys[:500], most=500) == (xs[:500], ys[:500])  # short curves are drawn whole


def test_figures_are_saved_as_palette_pngs(tmp_path):
    plt = report.pyplot()
    if plt is None:
        pytest.skip("matplotlib is not installed")
    from PIL import Image

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot(range(100), [x**0.5 for x in range(100)], label="a curve")
    ax.legend()
    report.save_png(fig, tmp_path / "plot.png")
    with Image.open(tmp_path / "plot.png") as image:
        assert image.mode == "P" and image.width <= 4 * report.PNG_DPI
    assert not plt.get_fignums()  # closed


@pytest.mark.parametrize("text, settings", [
    ("window:attn=triton,window=256", ("window", {"attn": "triton", "window": "256"})),
    ("dense:", ("dense", {})),
    ("moba-128:attn=moba,moba_block=128,", ("moba-128", {"attn": "moba", "moba_block": "128"})),
])
def test_parse_variant(text, settings):
    assert compare.parse_variant(text) == settings


@pytest.mark.parametrize("text, message", [
    ("window", "write name:key=value"), ("../x:attn=sdpa", "write name:key=value"),
    ("w:window", "'window' is not key=value"), ("w:out_dir=/tmp", "compare.py sets --out_dir for each run itself"),
])
def test_bad_variants_say_how_to_write_one(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compare.parse_variant(text)


def test_variants_flags_come_last_and_cannot_be_given_twice(tmp_path, capsys):
    args, train_args = compare.parse_args(["--variants", "dense:attn=triton", "window:attn=triton,window=256",
                                           "--out_dir", str(tmp_path), "--", "configs/x.py", "--max_steps=5"])
    assert list(args.variants) == ["dense", "window"] and args.reference == "dense"
    cmd = compare.train_command("window", args.seed, tmp_path / "window", args, train_args)
    assert cmd[-6:-3] == ["--max_steps=5", "--attn=triton", "--window=256"] and cmd[-1] == "--wandb_run_name=window"
    with pytest.raises(ValueError, match="compare.py sets --window per run"):  # it would change one variant only
        compare.train_command("dense", args.seed, tmp_path, args, ["--window=128"])
    for argv, message in ([["--variants", "a:", "a:window=8"], "two runs share a name"],
                          [["--variants", "a:", "--backends", "sdpa"], "not allowed with argument"],
                          [["--variants", "a:", "--reference", "b"], "--reference b is none of the runs: a"]):
        with pytest.raises(SystemExit):
            compare.parse_args(argv)
        assert message in capsys.readouterr().err


def test_train_command_lets_user_flags_override_defaults_but_not_per_backend_ones(tmp_path):
    args, train_args = compare.parse_args(["--backends", "sdpa,triton", "--out_dir", str(tmp_path), "--wandb", "true",
                                           "--", "configs/x.py", "--max_steps=5", "--seed=7"])
    cmd = compare.train_command("triton", args.seed, tmp_path / "triton", args, train_args)
    assert cmd[1].endswith("train.py") and cmd[2] == "configs/x.py"  # config files first: flags override them
    assert cmd.index("--seed=1337") < cmd.index("--seed=7")  # train.py applies left to right: the user's seed wins
    assert "--wandb=true" in cmd and f"--wandb_group={tmp_path.name}" in cmd and "--wandb_run_name=triton" in cmd
    assert cmd[-4:-2] == ["--attn=triton", f"--out_dir={tmp_path / 'triton'}"]
    with pytest.raises(ValueError, match="compare.py sets --attn"):
        compare.train_command("sdpa", args.seed, tmp_path, args, ["--attn=naive"])
    assert compare.parse_args(["--", "c.py"])[0].variants == {b: {"attn": b} for b in ("naive", "compile", "sdpa", "triton")}


def toy_token_shards(tmp_path) -> Path:
    """A data folder of random train and val tokens under a vocabulary of 512, for toy train.py runs."""
    return token_shards(tmp_path / "data", 512, {"train": 20_000, "val": 20_000})


def test_compare_checks_every_backend_runs_here_before_starting_any(tmp_path, monkeypatch, capsys):
    # the docstring's CPU example without the interpreter: triton cannot run, so sdpa must not start either
    from attention.flash import device

    monkeypatch.setattr(device, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        compare.main(["--backends", "sdpa,triton", "--wandb=false", "--out_dir", str(tmp_path / "cmp"), "--",
                      str(ROOT / "configs" / "smoke_cpu.py")])
    assert str(stop.value).startswith("compare.py: run 'triton': --attn=triton: the triton attention kernels run on a "
                                      "CUDA GPU, and this runs on cpu") and "\n" not in str(stop.value)
    assert not (tmp_path / "cmp").exists() and capsys.readouterr().out == ""  # no run started


@pytest.mark.slow
def test_compare_runs_train_py_per_backend_and_reports(tmp_path):
    data, out = toy_token_shards(tmp_path), tmp_path / "cmp"
    code = compare.main(["--backends", "naive,sdpa", "--out_dir", str(out), "--wandb", "false", "--skip_steps", "0", "--",
                         str(ROOT / "configs" / "smoke_cpu.py"), f"--data_dir={data}", "--vocab_size=512", "--max_steps=4", "--log_interval=1",
                         "--warmup_steps=1", "--eval_interval=2", "--eval_iters=1", "--sample_interval=0"])
    assert code == 0
    b = json.loads((out / "comparison.json").read_text())["backends"]
    assert set(b) == {"naive", "sdpa"} and all(row["status"] == "ok" for row in b.values())
    assert b["naive"]["last_step"] == 3 and b["naive"]["timed_steps"] == 1  # steps 0-2 are train.py's warm-up
    # same seed and data: the two backends compute the same attention, so the losses agree closely
    assert b["naive"]["max_abs_train_diff"] < 1e-3 and b["naive"]["max_abs_val_diff"] < 1e-3
    assert b["sdpa"]["speedup_vs_naive"] > 0
    assert (out / "loss.png").exists() and (out / "naive" / "train.log").read_text()
    assert json.loads((out / "sdpa" / "run.json").read_text())["returncode"] == 0


@pytest.mark.slow
def test_compare_runs_named_variants_dense_window_and_moba(tmp_path):
    data, out = toy_token_shards(tmp_path), tmp_path / "cmp"
    # smoke_cpu.py: T=64, head dim 16; MoBA blocks of 32 (the interpreter's tile), its own block only
    variants = ["dense:attn=sdpa", "window:attn=sdpa,window=8", "moba:attn=moba,moba_block=32,moba_topk=0"]
    code = compare.main(["--variants", *variants, "--out_dir", str(out), "--wandb", "false", "--skip_steps", "0", "--",
                         str(ROOT / "configs" / "smoke_cpu.py"), f"--data_dir={data}", "--vocab_size=512", "--max_steps=4",
                         "--n_layer=1", "--batch_size=2", "--log_interval=1", "--warmup_steps=1", "--eval_interval=2",
                         "--eval_iters=1", "--sample_interval=0"])
    assert code == 0
    summary = json.loads((out / "comparison.json").read_text())
    b = summary["backends"]
    assert list(b) == ["dense", "window", "moba"] and summary["reference"] == "dense"
    assert all(row["status"] == "ok" and row["last_step"] == 3 for row in b.values())
    assert b["window"]["max_abs_train_diff"] > 1e-4 and b["moba"]["max_abs_train_diff"] > 1e-4  # not dense attention
    assert "window=8, cpu" in (out / "window" / "train.log").read_text()
    assert json.loads((out / "moba" / "run.json").read_text())["settings"]["attn"] == "moba"
    assert (out / "loss.png").exists()
    with pytest.raises(SystemExit, match="run 'bad': model: window=8 with attn='moba'"):  # checked before any run
        compare.main(["--variants", "bad:attn=moba,window=8", "--out_dir", str(tmp_path / "bad"), "--", "--device=cpu"])
    assert not (tmp_path / "bad").exists()


def test_launch_timeline_marks_the_triton_function_and_restores_it():
    from attention.flash.autograd import FlashAttentionFunction
    from benchmarks import launch_overhead

    plain = FlashAttentionFunction.forward, FlashAttentionFunction.backward
    q, k, v = qkv(1, 2, 2, 32, 32, 16, requires_grad=True)
    do = torch.randn_like(q)
    spans = {backend: launch_overhead.timeline(backend, q, k, v, do, calls=3, sync=lambda: None)
             for backend in ("triton", "sdpa")}
    names = [name for name, _, _ in launch_overhead.SPANS]
    assert list(spans["triton"]) == names  # every span, the Function's own ones included
    assert list(spans["sdpa"]) == ["forward", "grad", "whole"]  # no Function of ours to mark
    for times in spans.values():
        assert all(t > 0 for t in times.values())
        assert times["whole"] >= max(times["forward"], times["grad"])
    assert (FlashAttentionFunction.forward, FlashAttentionFunction.backward) == plain


def test_documents_benchmark_times_every_path_on_the_same_documents(tmp_path):
    from benchmarks import documents

    ids = documents.uneven_documents(3, 50, 4, seed=0)
    assert all(len(torch.unique(row)) == 4 for row in ids)  # four documents per row, cut at random
    cu, longest = documents.cu_seqlens(ids)
    assert cu[-1] == 150 and len(cu) == 13 and longest == int((cu[1:] - cu[:-1]).max())
    out = documents.main(["--device", "cpu", "--seq_lens", "32", "--rounds", "1", "--rep_ms", "0",
                          "--tokens", "64", "--out_dir", str(tmp_path)])
    cell = json.loads((out / "results.json").read_text())["cells"][0]
    assert set(cell["ms"]) == {"per call", "prebuilt", "varlen", "dense causal", "prebuilt again"}
    assert all(ms > 0 for ms in cell["ms"].values()) and cell["build_ms"]["ours"] > 0
    assert "| 16 | 32 |" in (out / "results.md").read_text()
