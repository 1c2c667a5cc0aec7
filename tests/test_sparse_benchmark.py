"""The sparse benchmark at toy sizes on CPU: its masks and FLOP counts against masks.py and moba.py,
an end-to-end run through the naive backend, its report (speed-ups, issue 5's targets) and resuming."""
import json

import pytest
import torch
from helpers import markdown_section, qkv

from attention import attention
from attention.masks import dense_mask, mask_fn_mask
from attention.moba.reference import moba_mask, moba_select
from benchmarks import sparse
from benchmarks.attention import Shape
from benchmarks.report import fmt
from benchmarks.sparse_report import write_report

TOY = sparse.parse_args(["--device", "cpu"])  # window 16, MoBA block 16 top-2, documents of 5..40 tokens


def test_packed_documents_are_sorted_random_lengths_and_reproducible():
    ids = sparse.packed_document_ids(3, 500, [5, 40], seed=1, device="cpu")
    assert ids.shape == (3, 500) and ids.dtype == torch.int32
    assert (ids.diff(dim=1) >= 0).all() and (ids[:, 0] == 0).all()
    for row in ids:
        lengths = torch.unique_consecutive(row, return_counts=True)[1]
        assert ((lengths[:-1] >= 5) & (lengths[:-1] <= 40)).all() and lengths[-1] <= 40  # the last one is cut
    assert len(set(map(tuple, ids.tolist()))) == 3  # every row its own documents
    assert torch.equal(ids, sparse.packed_document_ids(3, 500, [5, 40], seed=1, device="cpu"))
    assert not torch.equal(ids, sparse.packed_document_ids(3, 500, [5, 40], seed=2, device="cpu"))


@pytest.mark.parametrize("T", [40, 100])
def test_visible_pairs_count_the_masks(T):
    B = 2
    ids = sparse.packed_document_ids(B, T, TOY.doc_lengths, seed=0, device="cpu")
    rules = {"dense": {}, "window": {"window": (TOY.window, 0)}, "documents": {"document_ids": ids}}
    for family, kw in rules.items():
        visible = dense_mask(T, T, causal=True, batch=B, **kw).expand(B, 1, T, T)
        assert sparse.visible_pairs(family, B, T, TOY, ids) == int(visible.sum()), family
    q, k, _ = qkv(B, 3, 3, T, T, 8)
    per_head = moba_mask(moba_select(q, k, TOY.block_size, TOY.topk), TOY.block_size, T).sum((-1, -2))
    assert (per_head.sum(0) == sparse.visible_pairs("moba", B, T, TOY)).all()


@pytest.mark.parametrize("family, rules", [("window", {"window": (16, 0)}), ("documents", {})])
def test_flex_mask_mods_are_the_masks_of_our_calls(family, rules):
    B, T = 2, 90
    ids = sparse.packed_document_ids(B, T, TOY.doc_lengths, seed=0, device="cpu")
    if family == "documents":
        rules = {"document_ids": ids}
    expected = dense_mask(T, T, causal=True, batch=B, **rules).expand(B, 1, T, T)
    got = mask_fn_mask(sparse.flex_mask_mod(family, TOY, ids), B, 1, T, T).expand(B, 1, T, T)
    assert torch.equal(got, expected)


@pytest.mark.slow
def test_flex_runs_the_window_mask_on_cpu_forward():
    # FlexAttention's backward is CUDA-only, but its compiled forward runs here (~10 s to compile)
    q, k, v = qkv(1, 2, 2, 128, 128, 16)
    run = sparse.flex("window", TOY, None, Shape(1, 2, 128, 16, True, "grid"), "cpu")
    torch.testing.assert_close(run(q, k, v, True), attention(q, k, v, window=(16, 0), backend="naive"))


def run_benchmark(tmp_path, *extra) -> tuple[dict, str]:
    out = sparse.main(["--device", "cpu", "--rep_ms", "1", "--out_dir", str(tmp_path), *extra])
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_cpu_run_measures_every_family_and_reports_from_the_json(tmp_path):
    results, md = run_benchmark(tmp_path)
    rows = results["rows"]
    labels = ["dense naive", "window naive", "documents naive", "moba naive"]
    assert [r["backend"] for r in rows[::4]] == labels  # 2 T x 2 passes per family
    assert [(r["T"], r["B"], r["nh"], r["hs"]) for r in rows[:4:2]] == [(64, 4, 2, 16), (128, 2, 2, 16)]
    for r in rows:
        assert r["status"] == "ok" and r["ms"] > 0 and r["ms_per_sequence"] == r["ms"] / r["B"]
        flops = 4 * r["nh"] * r["hs"] * r["visible_pairs"] * {"fwd": 1, "fwd+bwd": 3.5}[r["pass"]]
        assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12)
    assert results["settings"]["backend"] == "naive" and results["settings"]["window"] == [16, 0]
    for name in ("results.csv", "results.md", "time_vs_T.png"):
        assert (tmp_path / name).stat().st_size > 0

    ms = {(r["backend"], r["T"], r["pass"]): r["ms"] for r in rows}
    header, table = markdown_section(md, "Forward + backward: speed-ups (first's time / second's time)")
    assert header == ["B", "nh", "T", "hs", "dense / window", "dense / documents", "dense / moba"]  # no flex on CPU
    assert table[1][6] == fmt(ms[("dense naive", 128, "fwd+bwd")] / ms[("moba naive", 128, "fwd+bwd")])

    (tmp_path / "results.md").unlink()
    write_report(tmp_path)
    assert (tmp_path / "results.md").read_text() == md


def test_model_layout_runs_on_views_of_one_projection_and_says_so(tmp_path):
    from benchmarks.attention import inputs_of

    q, k, v, do = inputs_of(2, 3, 32, 16, torch.float32, torch.device("cpu"), "model")
    assert q.is_leaf and q.requires_grad and not k.is_contiguous() and q.shape == do.shape == (2, 3, 32, 16)
    assert q.stride() == (32 * 3 * 3 * 16, 16, 3 * 3 * 16, 1)  # (B, T, 3, nh, hs) underneath
    results, md = run_benchmark(tmp_path, "--families", "moba", "--seq_lens", "64", "--passes", "fwd+bwd",
                                "--layout", "model")
    assert results["settings"]["layout"] == "model" and all(r["status"] == "ok" for r in results["rows"])
    assert "q, k, v transposed views of one (B, T, 3, nh, hs) tensor" in md
    with pytest.raises(SystemExit, match="other settings"):  # contiguous cells do not resume a model-layout run
        run_benchmark(tmp_path, "--families", "moba", "--seq_lens", "64", "--passes", "fwd+bwd", "--resume")


def test_resume_measures_only_what_is_missing_and_refuses_other_settings(tmp_path):
    first, _ = run_benchmark(tmp_path, "--families", "window", "--seq_lens", "32", "--passes", "fwd")
    resumed, _ = run_benchmark(tmp_path, "--families", "window,moba", "--seq_lens", "32", "--passes", "fwd", "--resume")
    assert resumed["rows"][:1] == first["rows"]
    assert [r["backend"] for r in resumed["rows"]] == ["window naive", "moba naive"]
    with pytest.raises(SystemExit, match="other settings"):
        run_benchmark(tmp_path, "--families", "window", "--seq_lens", "32", "--window", "8", "--resume")


def test_report_of_a_gpu_run_checks_issue_5_targets(tmp_path):
    def row(backend, T, ms, status="ok"):
        ok = status == "ok"
        return {"backend": backend, "family": backend.split()[0], "B": max(1, 16384 // T), "nh": 16, "T": T,
                "hs": 128, "causal": True, "group": "grid", "pass": "fwd+bwd", "ms": ms if ok else None,
                "tflops": 1.0 if ok else None, "peak_mem_gib": 1.0 if ok else None, "status": status,
                "visible_pairs": 1, "ms_per_sequence": ms / max(1, 16384 // T) if ok else None}

    rows = [
        row("dense triton", 16384, 40.0), row("dense triton", 32768, 150.0),
        row("window triton", 16384, 5.0), row("window flex", 16384, 6.0),
        row("window triton", 32768, 5.5), row("window flex", 32768, 5.0),  # slower than flex here
        row("documents triton", 16384, 4.0), row("documents flex", 16384, None, status="skipped: out of memory"),
        row("moba triton", 32768, 30.0),
    ]
    env = {"device": "cuda", "gpu": "NVIDIA H200", "driver": "570", "cuda": "12.8", "torch": "2.11", "triton": "3.6",
           "date": "2026-11-22", "platform": "Linux"}
    settings = {k: "x" for k in ("timer", "flops", "memory", "compile")} | {
        "dtype": "bf16", "backend": "triton", "passes": ["fwd+bwd"], "window": [1024, 0], "block_size": 512,
        "topk": 3, "doc_lengths": [100, 2000], "seed": 0, "rep_ms": 100}
    (tmp_path / "results.json").write_text(json.dumps({"env": env, "settings": settings, "rows": rows}))
    write_report(tmp_path)

    md = (tmp_path / "results.md").read_text()
    _, targets = markdown_section(md, "Issue 5's speed targets (forward + backward)")
    assert targets[0][2:] == [f"{fmt(5.0 / 5.5)}x at B=1 nh=16 T=32768 hs=128", "missed"]
    assert targets[1][2:] == ["-", "not measured"]
    assert targets[2][2:] == [f"{fmt(150 / 30)}x at B=1 nh=16 T=32768 hs=128", "met"]
    header, speedups = markdown_section(md, "Forward + backward: speed-ups (first's time / second's time)")
    assert header[4:] == ["window: flex / ours", "dense / window", "dense / documents", "dense / moba"]
    assert speedups[0][4:] == [fmt(6 / 5), fmt(40 / 5), fmt(40 / 4), "-"]
    assert "documents flex at B=1 nh=16 T=16384 hs=128 causal=True: skipped: out of memory" in md
    assert "## Peak memory of forward + backward" in md and (tmp_path / "time_vs_T.png").stat().st_size > 0


@pytest.mark.parametrize("argv, match", [(["--families", "sparse"], "unknown family"),
                                         (["--doc_lengths", "50,10"], "lo <= hi"),
                                         (["--passes", "backward"], "unknown pass")])
def test_bad_flags_are_rejected(argv, match, capsys):
    with pytest.raises(SystemExit):
        sparse.parse_args(["--device", "cpu", *argv])
    assert match in capsys.readouterr().err
