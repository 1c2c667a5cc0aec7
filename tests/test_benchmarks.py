"""The kernel benchmark at toy sizes on CPU (benchmarks/attention.py and its report): FLOP counts, the grid, the
rounds in rotating order, skips and resumes, results.json; the training comparison is in test_compare.py."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, markdown_section

from benchmarks import attention as bench
from benchmarks import compare, report
from benchmarks.attention_report import write_report
from benchmarks.report import fmt


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
            assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12, rel=1e-5)  # six figures kept
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


def test_rotations_start_further_along_and_change_what_comes_before_each_item():
    assert report.rotations(["x", "y", "z"], 4) == [["x", "y", "z"], ["y", "x", "z"], ["z", "x", "y"], ["x", "z", "y"]]
    assert report.rotations(["x"], 2) == [["x"], ["x"]]
    assert report.rotations([], 2) == [[], []]
    cells = list(range(24))  # the terms stage's 12 candidates x 2 passes
    orders = report.rotations(cells, 5)
    assert all(sorted(order) == cells for order in orders)
    assert [order[0] for order in orders] == [0, 1, 2, 3, 4]
    before = {cell: {order[order.index(cell) - 1] for order in orders if order.index(cell)} for cell in cells}
    assert min(len(b) for b in before.values()) >= 4  # rotation alone left one predecessor per cell


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
