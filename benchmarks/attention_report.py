"""Tables and plots of a kernel benchmark, made from its results.json alone so that they can never
drift from the measurements. Redraw a results folder with:

    python -m benchmarks.attention_report out/kernels

Writes results.csv, results.md, tflops_<pass>.png (TFLOP/s against T, one panel per head dim and mask,
one line per backend) and memory.png (peak fwd+bwd memory against T, log scale).
"""
import argparse
import json
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python benchmarks/<this file>` works too

from benchmarks.report import fmt, markdown_table, pyplot, save_png, write_csv

PASS_TITLES = {"fwd": "Forward", "bwd": "Backward", "fwd+bwd": "Forward + backward"}
SHAPE_KEYS = ("B", "nh", "T", "hs", "causal")
OURS = ("triton", "cuda")  # the project's own kernels: each gets a speed-up table
TUNED = "triton"  # the backend whose tuner choices the runs record


def shape_of(row: dict) -> tuple:
    return tuple(row[key] for key in SHAPE_KEYS)


def unique(items) -> list:
    return list(dict.fromkeys(items))  # first-seen order: the order the run measured them in


def cell(row: dict | None, key: str) -> str:
    if row is None:
        return "-"  # not asked for
    if row["status"] != "ok":
        return "skip" if row["status"].startswith("skipped") else "error"
    return fmt(row[key])


class Results:
    """results.json indexed by (backend, shape, pass)."""

    def __init__(self, data: dict):
        self.env, self.settings, self.rows = data["env"], data["settings"], data["rows"]
        self.backends = unique(r["backend"] for r in self.rows)
        self.shapes = unique(shape_of(r) for r in self.rows)
        self.passes = [p for p in PASS_TITLES if any(r["pass"] == p for r in self.rows)]
        self.by_key = {(r["backend"], shape_of(r), r["pass"]): r for r in self.rows}

    def get(self, backend, shape, pass_) -> dict | None:
        return self.by_key.get((backend, shape, pass_))

    def value_table(self, pass_: str, key: str) -> str:
        rows = [[*map(str, shape)] + [cell(self.get(b, shape, pass_), key) for b in self.backends] for shape in self.shapes]
        return markdown_table([*SHAPE_KEYS, *self.backends], rows)

    def speedup_table(self, pass_: str, ours_name: str) -> str:
        """One of our kernels' speed-up over each other backend: that backend's time / ours."""
        others = [b for b in self.backends if b != ours_name]
        rows = []
        for shape in self.shapes:
            ours = self.get(ours_name, shape, pass_)
            row = [*map(str, shape)]
            for b in others:
                theirs = self.get(b, shape, pass_)
                ok = ours and theirs and ours["status"] == theirs["status"] == "ok"
                row.append(fmt(theirs["ms"] / ours["ms"]) if ok else "-")
            rows.append(row)
        return markdown_table([*SHAPE_KEYS, *(f"vs {b}" for b in others)], rows)

    def tuner_table(self) -> str | None:
        """Our kernels' tuner choices per shape (benchmarks/attention.py records them), or None if none were."""
        choices = {shape_of(r): r["tuner"] for r in self.rows if r["backend"] == TUNED and r.get("tuner")}
        if not choices:
            return None
        kernels = unique(kernel for chosen in choices.values() for kernel in chosen)
        rows = [[*map(str, shape)] + [f"`{chosen[k]}`" if k in chosen else "-" for k in kernels]
                for shape, chosen in choices.items()]
        return markdown_table([*SHAPE_KEYS, *kernels], rows)

    def failures(self) -> list[str]:
        """One line per backend and reason, naming the shapes (and passes, unless all) it covers."""
        cells: dict[tuple[str, str], dict[str, list[str]]] = {}
        for r in self.rows:
            if r["status"] != "ok":
                shape = " ".join(f"{k}={r[k]}" for k in SHAPE_KEYS)
                cells.setdefault((r["backend"], r["status"]), {}).setdefault(shape, []).append(r["pass"])
        lines = []
        for (backend, status), shapes in cells.items():
            where = [s if passes == self.passes else f"{s} ({', '.join(passes)})" for s, passes in shapes.items()]
            lines.append(f"- {backend} at {'; '.join(where)}: {status}")
        return lines

    def grid_panels(self) -> tuple[list[int], list[bool]]:
        """Head dims (plot rows) and masks (plot columns) of the grid; the GPT-2 shape is in the tables only."""
        grid = [r for r in self.rows if r["group"] == "grid"]
        return unique(r["hs"] for r in grid), unique(r["causal"] for r in grid)

    def series(self, backend, pass_, hs, causal, key) -> tuple[list, list]:
        """T and `key` of the grid's measured cells for one line of a plot."""
        points = sorted(
            (r["T"], r[key])
            for r in self.rows
            if (r["backend"], r["pass"], r["hs"], r["causal"], r["group"]) == (backend, pass_, hs, causal, "grid")
            and r["status"] == "ok" and r[key] is not None
        )
        return [t for t, _ in points], [y for _, y in points]


def markdown(res: Results) -> str:
    env, s = res.env, res.settings
    machine = f"{env['gpu']}, driver {env['driver']}, CUDA {env['cuda']}" if env["gpu"] else f"CPU ({env['platform']})"
    out = [
        "# Attention kernel benchmark\n",
        f"{machine}, torch {env['torch']}, triton {env['triton']}, {s['dtype']}, {env['date']}.\n",
        f"- timer: {s['timer']}, {s['rep_ms']} ms per cell after a warm-up call (compilation and autotuning excluded)"
        + (f"; the median of {s['rounds']} rounds, each timing every backend once, the order rotating"
           if s.get("rounds", 1) > 1 else ""),
        f"- TFLOP/s: {s['flops']}",
        f"- memory: {s['memory']}",
        f"- compiled backends: {s['compile']}",
        "- cells: `skip` = not run (reason below), `error` = the backend rejected the shape (reason below)\n",
    ]
    for pass_ in res.passes:
        title = PASS_TITLES[pass_]
        out += [f"## {title}: TFLOP/s\n", res.value_table(pass_, "tflops")]
        out += [f"## {title}: ms\n", res.value_table(pass_, "ms")]
        for ours in (b for b in OURS if b in res.backends):
            out += [f"## {title}: {ours} speed-up (backend's time / {ours}'s time)\n", res.speedup_table(pass_, ours)]
    if "fwd+bwd" in res.passes and res.env["device"] == "cuda":
        out += ["## Peak memory of forward + backward, GiB beyond the inputs\n", res.value_table("fwd+bwd", "peak_mem_gib")]
    tuner = res.tuner_table()
    if tuner:
        out += [f"## {TUNED}: the tuner's choices\n", tuner,
                "fwd, dq, dkdv: (tile, variant), variant hopper = the warp-specialized forward (§12) with a (BLOCK_N, "
                "K_STAGES, V_STAGES, PERSISTENT, CONSUMERS) tile; bwd: None = the dq and dkdv kernels ran, else the "
                "Hopper backward (§13) with a (STAGES, DKDV_STAGED) tile\n"]
    failures = res.failures()
    if failures:
        out += ["## Cells not measured\n", *failures, ""]
    return "\n".join(out)


def plot(res: Results, pass_: str, key: str, ylabel: str, path: Path, log_y: bool) -> None:
    head_dims, causals = res.grid_panels()
    plt = pyplot() if head_dims else None
    if plt is None:
        return
    fig, axes = plt.subplots(len(head_dims), len(causals), figsize=(6 * len(causals), 4 * len(head_dims)), squeeze=False)
    batches = {r["B"] for r in res.rows if r["group"] == "grid"}
    held = f"B={batches.pop()} fixed" if len(batches) == 1 else "B*T fixed"  # --batch, or the token-count grid
    for ax_row, hs in zip(axes, head_dims):
        for ax, causal in zip(ax_row, causals):
            seq_lens = set()
            for backend in res.backends:
                T, y = res.series(backend, pass_, hs, causal, key)
                if T:
                    ax.plot(T, y, marker="o", label=backend)
                    seq_lens.update(T)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(seq_lens), labels=[str(t) for t in sorted(seq_lens)])
            if log_y:
                ax.set_yscale("log")
            else:
                ax.set_ylim(bottom=0)
            ax.set_title(f"hs={hs}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel(f"sequence length T ({held})")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"{PASS_TITLES[pass_]} {ylabel}, {res.settings['dtype']}, {res.env['gpu'] or 'CPU'}")
    fig.tight_layout()
    save_png(fig, path)


def write_report(out_dir: Path) -> None:
    out_dir = Path(out_dir)
    res = Results(json.loads((out_dir / "results.json").read_text()))
    write_csv(out_dir / "results.csv", res.rows)
    (out_dir / "results.md").write_text(markdown(res))
    for pass_ in res.passes:
        plot(res, pass_, "tflops", "TFLOP/s", out_dir / f"tflops_{pass_.replace('+', '_')}.png", log_y=False)
    if "fwd+bwd" in res.passes and res.env["device"] == "cuda":
        plot(res, "fwd+bwd", "peak_mem_gib", "peak memory (GiB)", out_dir / "memory.png", log_y=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Redraw a kernel benchmark's tables and plots from its results.json")
    p.add_argument("out_dir", help="the folder holding results.json")
    write_report(p.parse_args().out_dir)
