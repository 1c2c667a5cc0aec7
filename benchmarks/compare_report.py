"""The training comparison's verdict, made only from the runs' own metrics.jsonl files, so it can be
re-run at any time and never disagrees with them:

    python -m benchmarks.compare_report benchmarks/results/compare-<id> [--reference sdpa] [--skip_steps 10]

For each backend folder <out_dir>/<backend>/ it reads metrics.jsonl (and run.json, which compare.py
writes beside it) and writes comparison.json, comparison.md and loss.png to <out_dir>.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python benchmarks/<this file>` works too

from benchmarks.report import fmt, markdown_table, pyplot, write_json


def read_metrics(path: Path) -> tuple[dict[int, dict], dict[int, float]]:
    """Train records and val losses of one run, by step. A step logged twice keeps its last record."""
    train, val = {}, {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "val_loss" in record:
            val[record["step"]] = record["val_loss"]
        else:
            train[record["step"]] = record
    return dict(sorted(train.items())), dict(sorted(val.items()))


def max_abs_diff(a: dict[int, float], b: dict[int, float]) -> float | None:
    """Largest |a - b| over the steps both runs logged; None when they share none."""
    common = a.keys() & b.keys()
    return max(abs(a[s] - b[s]) for s in common) if common else None


def median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize_run(train: dict[int, dict], val: dict[int, float], ref_train: dict, ref_val: dict, skip_steps: int) -> dict:
    losses = {step: r["train_loss"] for step, r in train.items()}
    # the first steps pay for compilation, autotuning and cold caches: they say nothing about steady
    # speed. train.py flags the first steps of every process "warmup"; skip_steps drops more on top.
    steady = [r for step, r in train.items() if step >= skip_steps and not r.get("warmup")]
    peaks = [r["peak_mem_gb"] for r in train.values() if r.get("peak_mem_gb") is not None]
    return {
        "last_step": max(train, default=None),
        "final_train_loss": losses[max(losses)] if losses else None,
        "final_val_loss": val[max(val)] if val else None,
        "max_abs_train_diff": max_abs_diff(losses, {s: r["train_loss"] for s, r in ref_train.items()}),
        "max_abs_val_diff": max_abs_diff(val, ref_val),
        "timed_steps": len(steady),
        "median_step_ms": median(steady, "step_ms"),
        "median_tokens_per_s": median(steady, "tokens_per_s"),
        "median_mfu": median(steady, "mfu"),
        "peak_mem_gb": max(peaks, default=None),
    }


def find_runs(out_dir: Path) -> list[str]:
    """Backend folders: those compare.py started (run.json) or that hold metrics."""
    return sorted(d.name for d in out_dir.iterdir() if (d / "run.json").exists() or (d / "metrics.jsonl").exists())


def load_runs(out_dir: Path) -> dict[str, dict]:
    runs = {}
    for name in find_runs(out_dir):
        run_json, metrics = out_dir / name / "run.json", out_dir / name / "metrics.jsonl"
        meta = json.loads(run_json.read_text()) if run_json.exists() else {}
        train, val = read_metrics(metrics) if metrics.exists() else ({}, {})
        runs[name] = {"meta": meta, "train": train, "val": val}
    return runs


def run_status(name: str, run: dict) -> str:
    code = run["meta"].get("returncode", 0)
    if code != 0:
        return f"failed: train.py exited with {code}, see {name}/train.log"
    return "ok" if run["train"] else "no metrics logged"


def summarize(runs: dict[str, dict], reference: str, skip_steps: int) -> dict:
    if reference not in runs:
        raise ValueError(f"reference backend {reference!r} has no run here (found {', '.join(runs) or 'none'}); "
                         "pass --reference with one of those")
    ref = runs[reference]
    backends = {
        name: {"status": run_status(name, run), **summarize_run(run["train"], run["val"], ref["train"], ref["val"], skip_steps)}
        for name, run in runs.items()
    }
    naive_ms = backends.get("naive", {}).get("median_step_ms")
    for row in backends.values():
        ms = row["median_step_ms"]
        row["speedup_vs_naive"] = naive_ms / ms if naive_ms and ms else None
    first_meta = next((run["meta"] for run in runs.values() if "env" in run["meta"]), {})
    # backends run by separate commands into one folder must still share every other setting
    arg_sets = {tuple(run["meta"]["train_args"]) for run in runs.values() if "train_args" in run["meta"]}
    warnings = [f"the runs were started with different train.py arguments: {sorted(arg_sets)}"] if len(arg_sets) > 1 else []
    return {
        "reference": reference,
        "skip_steps": skip_steps,
        "group": first_meta.get("group"),
        "env": first_meta.get("env"),
        "train_args": first_meta.get("train_args"),
        "warnings": warnings,
        "backends": backends,
    }


COLUMNS = [  # (header, key, scale)
    ("last step", "last_step", 1),
    ("final train loss", "final_train_loss", 1),
    ("final val loss", "final_val_loss", 1),
    ("max abs train diff", "max_abs_train_diff", 1),
    ("max abs val diff", "max_abs_val_diff", 1),
    ("median step ms", "median_step_ms", 1),
    ("tokens/s", "median_tokens_per_s", 1),
    ("MFU %", "median_mfu", 100),
    ("peak mem GB", "peak_mem_gb", 1),
    ("speed-up vs naive", "speedup_vs_naive", 1),
]


def markdown(summary: dict) -> str:
    env, ref = summary["env"] or {}, summary["reference"]
    rows = [
        [name] + [fmt(row[key] * scale if row[key] is not None else None) for _, key, scale in COLUMNS] + [row["status"]]
        for name, row in summary["backends"].items()
    ]
    lines = [
        "# Training comparison\n",
        f"Group `{summary['group']}`; {env.get('gpu') or 'CPU'}, torch {env.get('torch')}, triton {env.get('triton')}, "
        f"{env.get('date')}. train.py arguments: `{' '.join(summary['train_args'] or [])}`\n",
        f"- diffs: largest |loss(backend) - loss({ref})| over the steps both logged (same seed, same data order)",
        f"- step time, tokens/s, MFU: medians over the logged steps >= {summary['skip_steps']} that train.py did not "
        "flag as warm-up (those pay for compilation and cold caches); peak memory: the largest logged\n",
        *(f"**Warning: {w}**\n" for w in summary["warnings"]),
        "## Per backend\n",
        markdown_table(["backend", *(h for h, _, _ in COLUMNS), "status"], rows),
    ]
    return "\n".join(lines)


def plot_losses(runs: dict[str, dict], reference: str, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (curves, diffs) = plt.subplots(1, 2, figsize=(13, 4.5))
    ref_losses = {s: r["train_loss"] for s, r in runs[reference]["train"].items()}
    for i, (name, run) in enumerate(runs.items()):
        color = f"C{i}"  # one colour per backend in both panels
        steps = list(run["train"])
        if not steps:
            continue  # a run that failed before logging
        curves.plot(steps, [r["train_loss"] for r in run["train"].values()], color=color, label=f"{name} train", alpha=0.8)
        if run["val"]:
            curves.plot(list(run["val"]), list(run["val"].values()), "o--", color=color, label=f"{name} val")
        common = [s for s in steps if s in ref_losses]
        if name != reference and common:
            diffs.plot(common, [abs(run["train"][s]["train_loss"] - ref_losses[s]) for s in common], color=color, label=name)
    curves.set(xlabel="step", ylabel="loss", title="loss, all backends overlaid")
    diffs.set(xlabel="step", ylabel=f"|train loss - {reference}|", title=f"distance from {reference}")
    for ax in (curves, diffs):
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(out_dir, reference: str = "sdpa", skip_steps: int = 10) -> dict:
    out_dir = Path(out_dir)
    runs = load_runs(out_dir)
    summary = summarize(runs, reference, skip_steps)
    write_json(out_dir / "comparison.json", summary)
    (out_dir / "comparison.md").write_text(markdown(summary))
    plot_losses(runs, reference, out_dir / "loss.png")
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(description="Redo a training comparison's table and plot from its metrics.jsonl files")
    p.add_argument("out_dir", help="the comparison folder, holding one folder per backend")
    p.add_argument("--reference", default="sdpa", help="the backend the loss differences are measured against")
    p.add_argument("--skip_steps", type=int, default=10, help="steps before this are left out of the speed medians")
    args = p.parse_args(argv)
    write_report(args.out_dir, args.reference, args.skip_steps)
    print((Path(args.out_dir) / "comparison.md").read_text())


if __name__ == "__main__":
    main()
