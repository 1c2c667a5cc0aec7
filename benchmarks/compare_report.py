"""The training comparison's verdict, made only from the runs' own metrics.jsonl files, so it can be
re-run at any time and never disagrees with them:

    python -m benchmarks.compare_report out/compare-<id> [--reference sdpa] [--skip_steps 10]

For each run folder <out_dir>/<variant>/ it reads metrics.jsonl, or metrics.jsonl.gz as benchmarks/results/ keeps it
(and run.json, which compare.py writes beside it), and writes comparison.json, comparison.md and loss.png to <out_dir>.
"""
import argparse
import gzip
import json
import math
import statistics
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python benchmarks/<this file>` works too

from benchmarks.report import fmt, markdown_table, pyplot, save_png, thin, write_json


def read_metrics(path: Path) -> tuple[dict[int, dict], dict[int, float]]:
    """Train records and val losses of one run, by step. A step logged twice keeps its last record. A step train.py
    skipped for a non-finite loss (its train_loss null) is left out of the curves; skipped_steps counts it."""
    train, val = {}, {}
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    for line in text.splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "val_loss" in record:
            val[record["step"]] = record["val_loss"]
        elif record.get("train_loss") is not None:
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
        "min_val_loss": min(val.values(), default=None),
        "max_abs_train_diff": max_abs_diff(losses, {s: r["train_loss"] for s, r in ref_train.items()}),
        "max_abs_val_diff": max_abs_diff(val, ref_val),
        "timed_steps": len(steady),
        "median_step_ms": median(steady, "step_ms"),
        "median_tokens_per_s": median(steady, "tokens_per_s"),
        "median_mfu": median(steady, "mfu"),
        "peak_mem_gb": max(peaks, default=None),
        "skipped_steps": max((r.get("skipped_steps") or 0 for r in train.values()), default=0) or None,
    }


def metrics_file(run_dir: Path) -> Path | None:
    """A run's metrics.jsonl as train.py writes it, else the gzipped copy benchmarks/results/ keeps; None without."""
    return next((path for path in (run_dir / "metrics.jsonl", run_dir / "metrics.jsonl.gz") if path.exists()), None)


def find_runs(out_dir: Path) -> list[str]:
    """Run folders: those compare.py started (run.json) or that hold metrics."""
    return sorted(d.name for d in out_dir.iterdir() if (d / "run.json").exists() or metrics_file(d))


def load_runs(out_dir: Path) -> dict[str, dict]:
    runs = {}
    for name in find_runs(out_dir):
        run_json, metrics = out_dir / name / "run.json", metrics_file(out_dir / name)
        meta = json.loads(run_json.read_text()) if run_json.exists() else {}
        train, val = read_metrics(metrics) if metrics else ({}, {})
        runs[name] = {"meta": meta, "train": train, "val": val}
    # in the order compare.py ran them (its run.json numbers them), other folders after by name
    return dict(sorted(runs.items(), key=lambda item: item[1]["meta"].get("index", math.inf)))


def run_status(name: str, run: dict) -> str:
    code = run["meta"].get("returncode", 0)
    if code != 0:
        return f"failed: train.py exited with {code}, see {name}/train.log"
    return "ok" if run["train"] else "no metrics logged"


def speedup(baseline: dict | None, row: dict) -> float | None:
    """How many times faster row's median step is than baseline's; None when either has no timing."""
    base_ms, ms = (baseline or {}).get("median_step_ms"), row["median_step_ms"]
    return base_ms / ms if base_ms and ms else None


def default_reference(names) -> str | None:
    """sdpa when it ran (the backend comparison's yardstick), else the first run."""
    names = list(names)
    return "sdpa" if "sdpa" in names else names[0] if names else None


def summarize(runs: dict[str, dict], reference: str, skip_steps: int) -> dict:
    if reference not in runs:
        raise ValueError(f"reference run {reference!r} has no folder here (found {', '.join(runs) or 'none'}); "
                         "pass --reference with one of those")
    def ref_of(run: dict) -> dict:
        """The reference run of the same seed (with --seeds every variant runs each seed), else the reference."""
        variant, seed = runs[reference]["meta"].get("variant"), run["meta"].get("seed")
        same_seed = [other for other in runs.values()
                     if other["meta"].get("variant") == variant and other["meta"].get("seed") == seed]
        return same_seed[0] if variant is not None and same_seed else runs[reference]

    backends = {
        name: {"status": run_status(name, run), "settings": run["meta"].get("settings"),
               **summarize_run(run["train"], run["val"], ref_of(run)["train"], ref_of(run)["val"], skip_steps)}
        for name, run in runs.items()
    }
    for row in backends.values():
        row["speedup_vs_naive"] = speedup(backends.get("naive"), row)
        row["speedup_vs_reference"] = speedup(backends[reference], row)
    first_meta = next((run["meta"] for run in runs.values() if "env" in run["meta"]), {})
    # runs started by separate commands into one folder must still share every other setting
    arg_sets = {tuple(run["meta"]["train_args"]) for run in runs.values() if "train_args" in run["meta"]}
    warnings = [f"the runs were started with different train.py arguments: {sorted(arg_sets)}"] if len(arg_sets) > 1 else []
    return {
        "reference": reference,
        "skip_steps": skip_steps,
        "seeds": seed_spread(runs, backends),
        "group": first_meta.get("group"),
        "env": first_meta.get("env"),
        "train_args": first_meta.get("train_args"),
        "warnings": warnings,
        "backends": backends,  # one row per run; named when every run was a backend, kept for older readers
    }


def seed_spread(runs: dict[str, dict], rows: dict[str, dict]) -> dict | None:
    """With several seeds per variant (compare.py --seeds): per variant the final val and train losses' mean and
    sample standard deviation over its seeds, and the largest difference between two variants' mean final val
    losses, to hold against the seed-to-seed spread. None for a comparison of one seed."""
    by_variant: dict[str, list[str]] = {}
    for name, run in runs.items():
        by_variant.setdefault(run["meta"].get("variant", name), []).append(name)
    if all(len(names) == 1 for names in by_variant.values()):
        return None

    def spread(names: list[str], key: str) -> dict:
        values = [rows[n][key] for n in names if rows[n][key] is not None]
        return {"n": len(values), "mean": statistics.mean(values) if values else None,
                "sd": statistics.stdev(values) if len(values) > 1 else None}
    variants = {variant: {"runs": names, "final_val_loss": spread(names, "final_val_loss"),
                          "final_train_loss": spread(names, "final_train_loss")}
                for variant, names in by_variant.items()}
    means = [v["final_val_loss"]["mean"] for v in variants.values() if v["final_val_loss"]["mean"] is not None]
    sds = [v["final_val_loss"]["sd"] for v in variants.values() if v["final_val_loss"]["sd"] is not None]
    return {"variants": variants, "max_mean_diff": max(means) - min(means) if means else None,
            "min_sd": min(sds, default=None), "max_sd": max(sds, default=None)}


def mean_sd(cell: dict) -> str:
    return "-" if cell["mean"] is None else f"{cell['mean']:.4f} ± {fmt(cell['sd'])}"


COLUMNS = [  # (header, key, scale)
    ("last step", "last_step", 1),
    ("final train loss", "final_train_loss", 1),
    ("final val loss", "final_val_loss", 1),
    ("min val loss", "min_val_loss", 1),
    ("max abs train diff", "max_abs_train_diff", 1),
    ("max abs val diff", "max_abs_val_diff", 1),
    ("median step ms", "median_step_ms", 1),
    ("tokens/s", "median_tokens_per_s", 1),
    ("MFU %", "median_mfu", 100),
    ("peak mem GB", "peak_mem_gb", 1),
    ("skipped steps", "skipped_steps", 1),
    ("speed-up vs naive", "speedup_vs_naive", 1),
    ("speed-up vs reference", "speedup_vs_reference", 1),
]


def flags_text(settings: dict | None) -> str | None:
    return " ".join(f"--{key}={value}" for key, value in settings.items()) if settings else None


def markdown(summary: dict) -> str:
    env, ref, runs = summary["env"] or {}, summary["reference"], summary["backends"]
    cells = {name: {"flags": flags_text(row["settings"]), "status": row["status"],
                    **{key: fmt(row[key] * scale if row[key] is not None else None) for _, key, scale in COLUMNS}}
             for name, row in runs.items()}
    columns = [("flags", "flags"), *((header, key) for header, key, _ in COLUMNS), ("status", "status")]
    # a column no run has a value for (MFU on a CPU, speed-up vs naive without a naive run) is left out
    columns = [(header, key) for header, key in columns if any(c[key] not in (None, "-") for c in cells.values())]
    lines = [
        "# Training comparison\n",
        f"Group `{summary['group']}`; {env.get('gpu') or 'CPU'}, torch {env.get('torch')}, triton {env.get('triton')}, "
        f"{env.get('date')}. train.py arguments: `{' '.join(summary['train_args'] or [])}`; each run's flags follow them\n",
        f"- diffs: largest |loss(run) - loss({ref})| over the steps both logged (same seed, same data order; with "
        "several seeds, against the reference variant's run of the same seed); "
        f"speed-up vs reference: {ref}'s median step time over the run's",
        f"- step time, tokens/s, MFU: medians over the logged steps >= {summary['skip_steps']} that train.py did not "
        "flag as warm-up (those pay for compilation and cold caches); peak memory: the largest logged\n",
        *(f"**Warning: {w}**\n" for w in summary["warnings"]),
        "## Per run\n",
        markdown_table(["run", *(header for header, _ in columns)],
                       [[name, *(cells[name][key] for _, key in columns)] for name in runs]),
    ]
    seeds = summary.get("seeds")
    if seeds:
        lines += [
            "\n## Seed spread\n",
            "Final losses over each variant's seeds: mean ± sample standard deviation.\n",
            markdown_table(["variant", "seeds", "final val loss", "final train loss"],
                           [[variant, str(v["final_val_loss"]["n"]), mean_sd(v["final_val_loss"]),
                             mean_sd(v["final_train_loss"])] for variant, v in seeds["variants"].items()]),
            f"\nLargest difference between two variants' mean final val losses: {fmt(seeds['max_mean_diff'])}; "
            f"seed-to-seed standard deviation within a variant: {fmt(seeds['min_sd'])} to {fmt(seeds['max_sd'])}.",
        ]
    return "\n".join(lines)


def plot_losses(runs: dict[str, dict], summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (curves, diffs) = plt.subplots(1, 2, figsize=(13, 4.5))
    reference = summary["reference"]
    ref_losses = {s: r["train_loss"] for s, r in runs[reference]["train"].items()}
    variants = list(dict.fromkeys(run["meta"].get("variant", name) for name, run in runs.items()))
    for name, run in runs.items():
        color = f"C{variants.index(run['meta'].get('variant', name)) % 10}"  # one colour per variant in both panels
        steps = list(run["train"])
        if not steps:
            continue  # a run that failed before logging
        step_ms = summary["backends"][name]["median_step_ms"]
        speed = f", {fmt(step_ms)} ms/step" if step_ms is not None else ""
        curves.plot(*thin(steps, [r["train_loss"] for r in run["train"].values()]), color=color,
                    label=f"{name} train{speed}", alpha=0.8)
        if run["val"]:
            curves.plot(list(run["val"]), list(run["val"].values()), "o--", color=color, label=f"{name} val")
        common = [s for s in steps if s in ref_losses]
        if name != reference and common:
            diffs.plot(*thin(common, [abs(run["train"][s]["train_loss"] - ref_losses[s]) for s in common]), color=color,
                       label=name)
    curves.set(xlabel="step", ylabel="loss", title="loss, all runs overlaid")
    diffs.set(xlabel="step", ylabel=f"|train loss - {reference}|", title=f"distance from {reference}")
    diffs.set_yscale("symlog", linthresh=1e-7)  # float32 runs part at 1e-7 and grow by orders of magnitude
    for ax in (curves, diffs):
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    fig.tight_layout()
    save_png(fig, path)


def write_report(out_dir, reference: str | None = None, skip_steps: int = 10) -> dict:
    """reference: the run the loss differences and speed-ups are measured against (default_reference)."""
    out_dir = Path(out_dir)
    runs = load_runs(out_dir)
    summary = summarize(runs, reference or default_reference(runs), skip_steps)
    write_json(out_dir / "comparison.json", summary)
    (out_dir / "comparison.md").write_text(markdown(summary))
    plot_losses(runs, summary, out_dir / "loss.png")
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(description="Redo a training comparison's table and plot from its metrics.jsonl files")
    p.add_argument("out_dir", help="the comparison folder, holding one folder per run")
    p.add_argument("--reference", help="the run the loss differences are measured against (default sdpa, else the first)")
    p.add_argument("--skip_steps", type=int, default=10, help="steps before this are left out of the speed medians")
    args = p.parse_args(argv)
    write_report(args.out_dir, args.reference, args.skip_steps)
    print((Path(args.out_dir) / "comparison.md").read_text())


if __name__ == "__main__":
    main()
