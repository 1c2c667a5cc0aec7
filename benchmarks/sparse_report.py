"""Tables and plot of the sparse attention benchmark (benchmarks/sparse.py), made from its results.json
alone so that they can never drift from the measurements. Redraw a results folder with:

    python -m benchmarks.sparse_report benchmarks/results/<date>-<gpu>-sparse

Writes results.csv, results.md (ms, TFLOP/s of the visible work, speed-ups, issue 5's speed targets,
peak memory) and time_vs_T.png: forward+backward time per sequence against T on log-log axes, where
linear growth has slope 1 and quadratic slope 2 (dotted guides).
"""
import argparse
import json
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python benchmarks/<this file>` works too

from benchmarks.attention_report import PASS_TITLES, Results
from benchmarks.report import fmt, markdown_table, pyplot, save_png, write_csv

SHAPE_COLUMNS = ["B", "nh", "T", "hs"]


def speedup_columns(ours: str) -> list[tuple[str, str, str]]:
    """(column, slower backend, faster backend): each speed-up is the first's time / the second's."""
    return [
        ("window: flex / ours", "window flex", f"window {ours}"),
        ("documents: flex / ours", "documents flex", f"documents {ours}"),
        ("dense / window", f"dense {ours}", f"window {ours}"),
        ("dense / documents", f"dense {ours}", f"documents {ours}"),
        ("dense / moba", f"dense {ours}", f"moba {ours}"),
    ]


# issue 5's targets, forward + backward: (what, speed-up column, at least, only at these T or None = all)
TARGETS = [
    ("causal sliding window vs FlexAttention, same mask", "window: flex / ours", 1.0, None),
    ("document masking on packed batches vs FlexAttention", "documents: flex / ours", 1.0, None),
    ("MoBA (block 512, top-3) vs our dense causal kernel at T=32k", "dense / moba", 4.0, {32768}),
]


def speedups(res: Results, pass_: str) -> dict[str, dict[tuple, float]]:
    """column -> shape -> speed-up, for the cells where both backends ran."""
    table = {}
    for column, slow, fast in speedup_columns(res.settings["backend"]):
        table[column] = {}
        for shape in res.shapes:
            a, b = res.get(slow, shape, pass_), res.get(fast, shape, pass_)
            if a and b and a["status"] == b["status"] == "ok":
                table[column][shape] = a["ms"] / b["ms"]
    return table


def speedup_table(res: Results, pass_: str) -> str:
    table = {column: cells for column, cells in speedups(res, pass_).items() if cells}
    rows = [[*map(str, shape[:4])] + [fmt(table[c].get(shape)) for c in table] for shape in res.shapes]
    return markdown_table(SHAPE_COLUMNS + list(table), rows)


def targets_table(res: Results) -> str:
    table = speedups(res, "fwd+bwd")
    rows = []
    for what, column, need, seq_lens in TARGETS:
        cells = {shape: x for shape, x in table[column].items() if seq_lens is None or shape[2] in seq_lens}
        if not cells:
            rows.append([what, f">= {need}x", "-", "not measured"])
            continue
        worst = min(cells, key=cells.get)
        where = f"B={worst[0]} nh={worst[1]} T={worst[2]} hs={worst[3]}"
        rows.append([what, f">= {need}x", f"{fmt(cells[worst])}x at {where}", "met" if cells[worst] >= need else "missed"])
    return markdown_table(["target", "needed", "worst measured cell", "result"], rows)


def markdown(res: Results) -> str:
    env, s = res.env, res.settings
    lo, hi = s["doc_lengths"]
    machine = f"{env['gpu']}, driver {env['driver']}, CUDA {env['cuda']}" if env["gpu"] else f"CPU ({env['platform']})"
    out = [
        "# Sparse attention benchmark\n",
        f"{machine}, torch {env['torch']}, triton {env['triton']}, {s['dtype']}, {env['date']}.\n",
        (f"- ours = `{s['backend']}`; window = {tuple(s['window'])} (causal); documents of {lo}..{hi} tokens "
         f"packed, seed {s['seed']}; MoBA block {s['block_size']}, top-{s['topk']}"),
        ("- inputs: q, k, v transposed views of one (B, T, 3, nh, hs) tensor, as a model's fused projection leaves them"
         if s.get("layout") == "model" else "- inputs: q, k, v contiguous (B, nh, T, hs)"),
        f"- timer: {s['timer']}, {s['rep_ms']} ms per cell after a warm-up call"
        + (f"; the median of {s['rounds']} rounds, each timing every implementation once, the order rotating"
           if s.get("rounds", 1) > 1 else ""),
        f"- TFLOP/s: {s['flops']}",
        f"- memory: {s['memory']}",
        f"- compile: {s['compile']}",
        "- cells: `skip` = not run (reason below), `error` = the backend failed (reason below)\n",
    ]
    if "fwd+bwd" in res.passes:
        out += ["## Issue 5's speed targets (forward + backward)\n", targets_table(res)]
    for pass_ in res.passes:
        title = PASS_TITLES[pass_]
        out += [f"## {title}: ms\n", res.value_table(pass_, "ms")]
        out += [f"## {title}: TFLOP/s of the visible work\n", res.value_table(pass_, "tflops")]
        out += [f"## {title}: speed-ups (first's time / second's time)\n", speedup_table(res, pass_)]
    if "fwd+bwd" in res.passes and env["device"] == "cuda":
        out += ["## Peak memory of forward + backward, GiB beyond the inputs\n", res.value_table("fwd+bwd", "peak_mem_gib")]
    failures = res.failures()
    if failures:
        out += ["## Cells not measured\n", *failures, ""]
    return "\n".join(out)


def plot_time_vs_T(res: Results, pass_: str, path: Path) -> None:
    head_dims = sorted({r["hs"] for r in res.rows})
    plt = pyplot() if head_dims else None
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(head_dims), figsize=(6 * len(head_dims), 4.5), squeeze=False)
    for ax, hs in zip(axes[0], head_dims):
        seq_lens = set()
        for backend in res.backends:
            T, ms = res.series(backend, pass_, hs, True, "ms_per_sequence")
            if T:
                ax.plot(T, ms, marker="o", label=backend)
                seq_lens.update(T)
        T, ms = res.series(f"dense {res.settings['backend']}", pass_, hs, True, "ms_per_sequence")
        if len(T) > 1:  # slope guides through dense's first point
            for power, style in ((1, ":"), (2, "--")):
                ax.plot(T, [ms[0] * (t / T[0]) ** power for t in T], style, color="gray", label=f"~T^{power}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted(seq_lens), labels=[str(t) for t in sorted(seq_lens)])
        ax.set_title(f"hs={hs}")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("ms per sequence (time / B)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{PASS_TITLES[pass_]} time, {res.settings['dtype']}, {res.env['gpu'] or 'CPU'}")
    fig.tight_layout()
    save_png(fig, path)


def write_report(out_dir: Path) -> None:
    out_dir = Path(out_dir)
    res = Results(json.loads((out_dir / "results.json").read_text()))
    write_csv(out_dir / "results.csv", res.rows)
    (out_dir / "results.md").write_text(markdown(res))
    if res.passes:
        plot_time_vs_T(res, "fwd+bwd" if "fwd+bwd" in res.passes else res.passes[0], out_dir / "time_vs_T.png")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Redraw the sparse benchmark's tables and plot from its results.json")
    p.add_argument("out_dir", help="the folder holding results.json")
    write_report(p.parse_args().out_dir)
