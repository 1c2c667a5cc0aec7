"""The benchmarks at toy sizes on CPU: the kernel sweep and its report, and the training comparison's
analysis (on synthetic metrics) and one real comparison of train.py."""
import csv
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, markdown_section, qkv, token_shards

from benchmarks import attention as bench
from benchmarks import compare, compare_report, report
from benchmarks.attention_report import write_report
from benchmarks.report import fmt


# ---------------------------------------------------------------------------------------------
# kernel benchmark


def test_flop_count_halves_for_causal_and_scales_backward():
    full = bench.attention_flops(2, 3, 128, 64, causal=False, pass_="fwd")
    assert full == 4 * 2 * 3 * 128 * 128 * 64
    assert bench.attention_flops(2, 3, 128, 64, causal=True, pass_="fwd") == full / 2
    assert bench.attention_flops(2, 3, 128, 64, causal=False, pass_="bwd") == 2.5 * full
    assert bench.attention_flops(2, 3, 128, 64, causal=True, pass_="fwd+bwd") == 3.5 * full / 2


def test_grid_keeps_tokens_and_width_fixed_and_rejects_uneven_sizes():
    fixed_batch = bench.grid_shapes([1024, 16384], [64], [True], tokens=16384, width=2048, batch=1)
    assert [(s.B, s.T) for s in fixed_batch] == [(1, 1024), (1, 16384)]
    shapes = bench.grid_shapes([1024, 16384], [64, 128], [True], tokens=16384, width=2048)
    assert [(s.B, s.nh, s.T, s.hs) for s in shapes] == [(16, 32, 1024, 64), (1, 32, 16384, 64), (16, 16, 1024, 128), (1, 16, 16384, 128)]
    with pytest.raises(ValueError, match="not a multiple of T=3000"):
        bench.grid_shapes([3000], [64], [True], tokens=16384, width=2048)
    with pytest.raises(ValueError, match="head dim 96"):
        bench.grid_shapes([1024], [96], [True], tokens=16384, width=2048)


def test_naive_skip_estimates_the_score_matrix_against_free_memory():
    shape = bench.Shape(B=1, nh=32, T=16384, hs=64, causal=True, group="grid")
    scores = 32 * 16384 * 16384  # 8.6e9 elements; naive needs ~16 bytes each in bf16
    reason = bench.score_memory_skip_reason("naive", shape, itemsize=2, free_bytes=100 * 2**30)
    assert reason.startswith("skipped: the T^2 score matrix needs ~128 GiB, 100 GiB free")
    assert bench.score_memory_skip_reason("naive", shape, itemsize=2, free_bytes=scores * 16) is None
    # compile fuses the fp32 softmax chain, so it fits where naive does not
    assert bench.score_memory_skip_reason("compile", shape, itemsize=2, free_bytes=100 * 2**30) is None
    assert bench.score_memory_skip_reason("sdpa", shape, itemsize=2, free_bytes=1) is None  # flash: no T^2 memory
    assert bench.score_memory_skip_reason("naive", shape, itemsize=2, free_bytes=None) is None  # CPU: not checked


def run_sweep(tmp_path, *extra) -> tuple[Path, dict]:
    out = bench.main(["--device", "cpu", "--rep_ms", "1", "--out_dir", str(tmp_path), *extra])
    return out, json.loads((out / "results.json").read_text())


def test_cpu_sweep_writes_every_output_and_records_rejected_backends(tmp_path):
    out, results = run_sweep(tmp_path, "--backends", "naive,sdpa,sdpa-efficient", "--seq_lens", "32,64",
                             "--head_dims", "16", "--causal", "true")
    rows = results["rows"]
    assert len(rows) == 3 * 2 * 3  # backends x shapes x passes
    assert results["env"]["device"] == "cpu" and "perf_counter" in results["settings"]["timer"]
    for r in rows:
        if r["backend"] == "sdpa-efficient":  # no CPU kernel: PyTorch raises, the sweep records it
            assert r["status"].startswith("error: RuntimeError") and r["ms"] is None
        else:
            assert r["status"] == "ok" and r["ms"] > 0 and r["peak_mem_gib"] is None
            flops = bench.attention_flops(r["B"], r["nh"], r["T"], r["hs"], r["causal"], r["pass"])
            assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12)
    for name in ("results.csv", "results.md", "tflops_fwd.png", "tflops_bwd.png", "tflops_fwd_bwd.png"):
        assert (out / name).stat().st_size > 0, name
    assert not (out / "memory.png").exists()  # no memory numbers on CPU
    with open(out / "results.csv") as f:
        assert [r["status"] for r in csv.DictReader(f)] == [r["status"] for r in rows]

    md = (out / "results.md").read_text()
    by_key = {(r["backend"], r["T"], r["pass"]): r for r in rows}
    for pass_, title in (("fwd", "Forward"), ("fwd+bwd", "Forward + backward")):
        for key, unit in (("tflops", "TFLOP/s"), ("ms", "ms")):
            header, table = markdown_section(md, f"{title}: {unit}")
            assert header == ["B", "nh", "T", "hs", "causal", "naive", "sdpa", "sdpa-efficient"]
            assert len(table) == 2
            for row in table:
                for backend, text in zip(header[5:], row[5:]):
                    r = by_key[(backend, int(row[2]), pass_)]
                    assert text == ("error" if r["status"] != "ok" else fmt(r[key]))
    assert "sdpa-efficient at B=4 nh=4 T=32 hs=16 causal=True; B=2 nh=4 T=64 hs=16 causal=True: error: RuntimeError" in md

    # the report is made from results.json alone: redrawing it gives the same document
    for path in out.iterdir():
        if path.name != "results.json":
            path.unlink()
    write_report(out)
    assert (out / "results.md").read_text() == md and (out / "tflops_fwd.png").exists()


def test_sweep_records_a_skip_and_resumes_without_remeasuring(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "free_memory_bytes", lambda device: 1024)  # pretend the device is full
    args = ("--backends", "naive,sdpa", "--seq_lens", "32", "--head_dims", "16", "--causal", "false", "--passes", "fwd")
    _, results = run_sweep(tmp_path, *args)
    status = {r["backend"]: r["status"] for r in results["rows"]}
    assert status["naive"].startswith("skipped: the T^2 score matrix needs") and status["sdpa"] == "ok"

    _, resumed = run_sweep(tmp_path, *args, "--resume", "--passes", "fwd,bwd")
    assert resumed["rows"][:2] == results["rows"]  # the cells already measured are kept as they were
    assert [(r["backend"], r["pass"]) for r in resumed["rows"][2:]] == [("naive", "bwd"), ("sdpa", "bwd")]


def test_rotations_start_each_round_one_further_along():
    assert report.rotations(["x", "y", "z"], 4) == [["x", "y", "z"], ["y", "z", "x"], ["z", "x", "y"], ["x", "y", "z"]]
    assert report.rotations(["x"], 2) == [["x"], ["x"]]
    assert report.rotations([], 2) == [[], []]


def test_tools_write_under_out_by_default(tmp_path, monkeypatch):
    # out/<name>/ (git-ignored), no longer dated folders under benchmarks/results/
    assert report.default_out_dir("kernels") == Path("out") / "kernels"
    monkeypatch.chdir(tmp_path)
    args, _ = compare.parse_args(["--", "c.py"])
    assert args.out_dir.parent == tmp_path / "out" and args.out_dir.name.startswith("compare-")


@pytest.mark.slow
def test_backends_are_timed_in_rounds_in_rotating_order_and_a_failure_stays_a_cell(monkeypatch):
    # a kernel runs at the clock the one timed before it left (docs/perf_notes.md): each round times every
    # (backend, pass) once, starting one further along, and a cell's ms is the median of its rounds
    timed = []

    def fake_median_ms(step, grads, device, rep_ms):
        step()
        timed.append(step.label)
        return {"a": 1.0, "b": 2.0}[step.label[0]] * (1 + len(timed) % 3)  # rounds differ; the median is 2x

    def labelled(fn, pass_, q, k, v, dout, causal):
        step = lambda: fn(q, k, v, causal)  # noqa: E731
        step.label = (fn.name, pass_)
        return step

    def backend(name, fails_on=None):
        def fn(q, k, v, causal):
            if fails_on is not None and len(timed) >= fails_on:
                raise RuntimeError("out of luck")
            return q
        fn.name = name
        return fn

    monkeypatch.setattr(bench, "median_ms", fake_median_ms)
    monkeypatch.setattr(bench, "pass_step", labelled)
    shape = bench.Shape(B=1, nh=1, T=4, hs=2, causal=True, group="grid")
    cells = bench.measure({"a": backend("a"), "b": backend("b", fails_on=4)}, shape,
                          {"a": ["fwd", "bwd"], "b": ["fwd"]}, torch.float32, torch.device("cpu"), 1.0, rounds=3)
    # round 1: a/fwd a/bwd b/fwd; round 2 starts at a/bwd; b fails in round 2 (its 4th timing on) and is not
    # timed again
    assert timed == [("a", "fwd"), ("a", "bwd"), ("b", "fwd"), ("a", "bwd"), ("a", "fwd"), ("a", "fwd"), ("a", "bwd")]
    assert cells["a"]["fwd"]["status"] == "ok" and cells["a"]["fwd"]["ms"] == 2.0
    assert cells["b"]["fwd"]["status"] == "error: RuntimeError: out of luck" and cells["b"]["fwd"]["ms"] is None
    assert list(cells) == ["a", "b"] and list(cells["a"]) == ["fwd", "bwd"]


def test_compiled_backend_never_hits_the_recompile_limit_over_the_grid(tmp_path):
    # a limit of one compile per function: every new shape would fail without the sweep's Dynamo reset.
    # torch's own config.patch, not monkeypatch: pytest >= 9.2 undoes a module-attribute patch with
    # delattr, which torch's config module treats as "hide this option" for the rest of the session
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        _, results = run_sweep(tmp_path, "--backends", "compile", "--seq_lens", "16,32,64", "--head_dims", "16",
                               "--causal", "true", "--passes", "fwd+bwd", "--tokens", "64", "--width", "16")
    assert [r["status"] for r in results["rows"]] == ["ok"] * 3


def test_triton_kernel_runs_from_the_command_line_under_the_interpreter(tmp_path):
    # as a user would start it: the script by its path (benchmarks/ must not shadow the attention
    # package) and no TRITON_INTERPRET set (the benchmark sets it before Triton is imported)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "benchmarks/attention.py", "--device", "cpu", "--backends", "sdpa,triton",
                    "--seq_lens", "16", "--head_dims", "16", "--causal", "true", "--tokens", "16", "--width", "16",
                    "--rep_ms", "1", "--out_dir", str(tmp_path)], cwd=ROOT, env=env, check=True, timeout=300)
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["status"] for r in results["rows"]] == ["ok"] * 6
    header, speedups = markdown_section((tmp_path / "results.md").read_text(),
                                        "Forward: triton speed-up (backend's time / triton's time)")
    fwd_ms = {r["backend"]: r["ms"] for r in results["rows"] if r["pass"] == "fwd"}
    assert header[5:] == ["vs sdpa"] and speedups[0][5:] == [fmt(fwd_ms["sdpa"] / fwd_ms["triton"])]
    # which of our kernels ran: the tuner's choice per kernel, recorded with each triton cell and reported
    assert all(set(r["tuner"]) == {"fwd", "dq", "dkdv"} for r in results["rows"] if r["backend"] == "triton")
    assert not any("tuner" in r for r in results["rows"] if r["backend"] == "sdpa")
    header, choices = markdown_section((tmp_path / "results.md").read_text(), "triton: the tuner's choices")
    assert header[5:] == ["fwd", "dq", "dkdv"] and len(choices) == 1
    # the CSV has the column though the first row (sdpa's) has no tuner
    with open(tmp_path / "results.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert [bool(r["tuner"]) for r in csv_rows] == [r["backend"] == "triton" for r in results["rows"]]


def test_results_json_has_a_line_per_key_and_per_row_and_reads_back_the_same(tmp_path):
    from benchmarks.report import write_json

    results = {"env": {"gpu": "H100", "torch": "2.11"}, "settings": {"rounds": 3, "seq_lens": [1024, 4096]},
               "rows": [{"backend": "triton", "ms": 0.5, "status": "ok"}, {"backend": "sdpa", "ms": None}], "empty": []}
    write_json(tmp_path / "results.json", results)
    text = (tmp_path / "results.json").read_text()
    assert json.loads(text) == results
    assert text.splitlines() == [
        "{",
        ' "env": {"gpu":"H100","torch":"2.11"},',
        ' "settings": {"rounds":3,"seq_lens":[1024,4096]},',
        ' "rows": [',
        '  {"backend":"triton","ms":0.5,"status":"ok"},',
        '  {"backend":"sdpa","ms":null}',
        " ],",
        ' "empty": []',
        "}",
    ]


def test_report_of_a_gpu_run_has_speedups_memory_and_skips(tmp_path):
    def row(backend, T, pass_, ms, mem=None, status="ok"):
        ok = status == "ok"
        return {"backend": backend, "B": 16384 // T, "nh": 32, "T": T, "hs": 64, "causal": True, "group": "grid",
                "pass": pass_, "ms": ms if ok else None, "tflops": 1.0 / ms if ok else None,
                "peak_mem_gib": mem if ok else None, "status": status}

    rows = [
        row("naive", 1024, "fwd+bwd", 8.0, mem=4.0), row("naive", 4096, "fwd+bwd", None, status="skipped: too big"),
        row("sdpa", 1024, "fwd+bwd", 2.0, mem=0.5), row("sdpa", 4096, "fwd+bwd", 6.0, mem=0.5),
        row("triton", 1024, "fwd+bwd", 1.6, mem=0.4), row("triton", 4096, "fwd+bwd", 5.0, mem=0.4),
    ]
    env = {"device": "cuda", "gpu": "NVIDIA H200", "driver": "570", "cuda": "12.8", "torch": "2.11", "triton": "3.6",
           "date": "2026-01-01", "platform": "Linux"}
    settings = {k: "x" for k in ("timer", "memory", "flops", "compile")} | {"dtype": "bf16", "rep_ms": 100, "passes": ["fwd+bwd"]}
    (tmp_path / "results.json").write_text(json.dumps({"env": env, "settings": settings, "rows": rows}))
    write_report(tmp_path)

    md = (tmp_path / "results.md").read_text()
    header, speedups = markdown_section(md, "Forward + backward: triton speed-up (backend's time / triton's time)")
    assert header[5:] == ["vs naive", "vs sdpa"]
    assert speedups[0][5:] == [fmt(8.0 / 1.6), fmt(2.0 / 1.6)] and speedups[1][5:] == ["-", fmt(6.0 / 5.0)]
    header, memory = markdown_section(md, "Peak memory of forward + backward, GiB beyond the inputs")
    assert memory[0][5:] == ["4", "0.5", "0.4"] and memory[1][5:] == ["skip", "0.5", "0.4"]
    assert "naive at B=4 nh=32 T=4096 hs=64 causal=True: skipped: too big" in md
    assert (tmp_path / "memory.png").stat().st_size > 0 and (tmp_path / "tflops_fwd_bwd.png").exists()


# ---------------------------------------------------------------------------------------------
# training comparison


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
