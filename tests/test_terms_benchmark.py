"""The terms benchmark (issue 47's speed table) at toy sizes on CPU: one run through Triton's interpreter on a few
candidates, its results.json and report; and the report's target marks on a made-up GPU run."""
import json
import math

from benchmarks import terms
from benchmarks.report import fmt
from benchmarks.terms_report import TERMS, write_report

# the fewest that touch every path: our kernel (plain, and sinks with its extra leaf), Flex (forward only on CPU:
# its fwd+bwd is a skip status) and sdpa's dropout; one causal setting keeps the interpreter's time down
CANDIDATES = ["plain", "sinks", "flex-softcap", "sdpa-dropout"]


def test_cpu_run_times_every_candidate_and_reports_every_term(tmp_path):
    terms.main(["--device", "cpu", "--causal", "true", "--candidates", ",".join(CANDIDATES),
                "--out_dir", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    cells = {(c["candidate"], c["pass"]): c for c in results["cells"]}
    assert set(cells) == {(name, p) for name in CANDIDATES for p in terms.PASSES}
    for (name, pass_), cell in cells.items():
        if name == "flex-softcap" and pass_ == "fwd+bwd":
            assert cell["ms"] is None and cell["status"].startswith("skipped: FlexAttention has no backward")
            continue
        assert cell["status"] == "ok" and len(cell["ms_rounds"]) == 1, (name, pass_, cell["status"])
        assert math.isfinite(cell["ms"]) and cell["ms"] > 0
    md = (tmp_path / "results.md").read_text()
    rows = {line.split("|")[1].strip() for line in md.splitlines() if line.startswith("| ")}
    assert set(TERMS) | {"A/A: plain again (noise)"} <= rows
    assert "at most 1.1x plain's (1.25x for dropout)" in md and "softcap >= 1.2x" in md and "dropout >= 1.3x" in md
    assert (tmp_path / "cost.png").stat().st_size > 0


def test_report_marks_the_cells_that_miss_their_targets(tmp_path):
    ms = {"plain": 10.0, "plain-again": 10.2, "softcap": 10.5, "alibi": 11.5, "sinks": 10.0, "dropout": 12.0,
          "return_lse": 10.0, "flex-softcap": 13.0, "flex-alibi": 12.0, "sdpa-dropout": 15.0}
    cells = [{"candidate": name, "causal": True, "pass": "fwd+bwd", "ms_rounds": [t], "ms": t, "status": "ok"}
             for name, t in ms.items()]
    env = {"gpu": "NVIDIA H100", "device": "cuda", "torch": "2.x", "triton": "3.x", "date": "today"}
    args = {"batch": 4, "heads": 16, "seq_len": 4096, "head_dim": 128, "dtype": "bf16", "rounds": 5}
    (tmp_path / "results.json").write_text(json.dumps({"env": env, "settings": {"timer": "do_bench"}, "args": args,
                                                       "cells": cells}))
    md = write_report(tmp_path).read_text()
    row = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in md.splitlines()
           if line.startswith("| ")}
    assert row["softcap"] == [fmt(1.05), "Flex", fmt(13 / 10.5)]  # within both targets
    assert row["ALiBi"] == [fmt(1.15) + "!", "Flex", fmt(12 / 11.5) + "!"]  # over 1.1x plain, under 1.2x Flex
    assert row["dropout"] == [fmt(1.2), "sdpa", fmt(15 / 12) + "!"]  # dropout may cost 25%, but is under 1.3x sdpa
    assert row["A/A: plain again (noise)"][0] == fmt(1.02)
