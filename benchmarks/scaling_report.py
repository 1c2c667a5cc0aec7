"""The multi-GPU scaling table (issues 50 and 51), made only from the files benchmarks/scaling.py leaves in its folder,
so it can be redrawn at any time and never disagrees with them:

    python -m benchmarks.scaling_report out/results/scaling/h100x2 [--skip_steps 5]

It reads plan.json (the machine, the runs planned and their settings) and each run's folder (run.json, metrics.jsonl
or metrics.jsonl.gz) and writes results.json and results.md:

- scaling: DDP at each number of GPUs n (n = 1 accumulates micro-batches to the same global batch): median tokens/s,
  tokens/s per GPU, scaling efficiency tokens/s(n) / (n * tokens/s(1)), and the train loss step by step minus the
  1-GPU run's; beside it the efficiency against single1, one GPU taking a rank's micro-batches a step: the same work
  per GPU and step, so what separates the two is the update, which the accumulating GPU takes n times less often;
- fsdp: FSDP2 beside DDP at the machine's N GPUs on the same model: tokens/s and per-GPU peak memory;
- large: the large model under FSDP2 at N GPUs: tokens/s, per-GPU peak memory, and the bytes its weights, gradients
  and AdamW moments alone would take per GPU under DDP;
- resume: a checkpoint written at N GPUs, resumed at N/2: its losses minus those of the run that wrote it;
- against (with --against): the large model's and FSDP2's figures beside another session's results.json (issue 51:
  4 GPUs against the 2-GPU session's), each row naming its machine;
- scaling.png: DDP's tokens/s against n beside the linear ideal, and each n's loss minus the 1-GPU run's by step.

Medians leave out the first --skip_steps steps and those train.py marks "warmup" (compilation). Peak memory is
train.py's peak_mem_gb: torch.cuda.max_memory_allocated() of rank 0 (FSDP2 shards evenly; rank 0 also holds DDP's
replica), the largest over the run.
"""
import argparse
import json
import re
import statistics
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python benchmarks/<this file>` works too

from benchmarks.compare_report import metrics_file, read_metrics
from benchmarks.report import fmt, markdown_table, pyplot, save_png, write_json

DEFAULT_SKIP_STEPS = 5
# fp32 weights and gradients and AdamW's two fp32 moments: what every DDP replica holds before any activation
STATE_BYTES_PER_PARAM = 16


def efficiency(tokens_per_s: float | None, gpus: int, tokens_per_s_1: float | None) -> float | None:
    """tokens/s at n GPUs over n times tokens/s at 1: 1.0 is perfect scaling."""
    if tokens_per_s is None or not tokens_per_s_1:
        return None
    return tokens_per_s / (gpus * tokens_per_s_1)


def loss_diffs(losses: dict[int, float], reference: dict[int, float]) -> dict[int, float]:
    """losses[step] - reference[step] for every step both logged, in step order."""
    return {step: losses[step] - reference[step] for step in sorted(losses.keys() & reference.keys())}


def max_abs(diffs: dict[int, float]) -> float | None:
    return max((abs(d) for d in diffs.values()), default=None)


def status_of(info: dict | None) -> str:
    if info is None:
        return "not run"
    if info.get("skipped"):
        return f"not run ({info['skipped']})"
    if info.get("timed_out"):
        return f"timed out after {info['wall_s']:.0f} s"
    return "ok" if info.get("returncode") == 0 else f"failed (exit {info.get('returncode')})"


def parameters(run_dir: Path) -> float | None:
    """The parameter count train.py's first line gives ("3838.6M parameters, ..."), from the run's train.log."""
    log = run_dir / "train.log"
    found = re.search(r"([\d.]+)M parameters", log.read_text(errors="replace")) if log.exists() else None
    return float(found.group(1)) * 1e6 if found else None


def summarize_run(run_dir: Path, skip_steps: int) -> dict:
    """One run's status and figures; its losses by step under "losses"."""
    info = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else None
    path = metrics_file(run_dir)
    train = read_metrics(path)[0] if path else {}
    first = min(train, default=0)  # a resumed run starts at its checkpoint's step
    steady = [r for step, r in train.items() if step - first >= skip_steps and not r.get("warmup")]

    def median(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    peaks = [r["peak_mem_gb"] for r in train.values() if r.get("peak_mem_gb") is not None]
    return {
        "status": status_of(info), "wall_s": info.get("wall_s") if info else None,
        "steps": len(train), "timed_steps": len(steady),
        "median_tokens_per_s": median("tokens_per_s"), "median_step_ms": median("step_ms"),
        "median_mfu": median("mfu"), "peak_mem_gb": max(peaks, default=None),
        "parameters": parameters(run_dir), "out_of_memory_at": info.get("out_of_memory_at") if info else None,
        "losses": {step: r["train_loss"] for step, r in train.items()},
    }


def summarize(out_dir: Path, skip_steps: int = DEFAULT_SKIP_STEPS) -> dict:
    plan = json.loads((out_dir / "plan.json").read_text())
    runs = {run["name"]: {**run, **summarize_run(out_dir / run["name"], skip_steps)} for run in plan["runs"]}
    ddp = sorted((run for run in runs.values() if run["kind"] == "ddp"), key=lambda run: run["gpus"])
    one = next((run for run in ddp if run["gpus"] == 1), None)
    base_tps, base_losses = (one["median_tokens_per_s"], one["losses"]) if one else (None, {})
    single = next((run for run in runs.values() if run["kind"] == "single"), None)
    single_tps = single["median_tokens_per_s"] if single else None
    scaling = []
    for run in ddp:
        diffs = loss_diffs(run["losses"], base_losses)
        tps = run["median_tokens_per_s"]
        scaling.append({
            "gpus": run["gpus"], "run": run["name"], "grad_accum": run["grad_accum"], "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps / run["gpus"] if tps is not None else None,
            "efficiency": efficiency(tps, run["gpus"], base_tps),
            "efficiency_per_step": efficiency(tps, run["gpus"], single_tps) if run["gpus"] > 1 else None,
            "peak_mem_gb": run["peak_mem_gb"],
            "max_abs_loss_diff": max_abs(diffs), "last_loss_diff": diffs[max(diffs)] if diffs else None,
            "loss_diff": diffs, "status": run["status"],
        })

    def by_kind(kind):
        return next((run for run in runs.values() if run["kind"] == kind), None)

    n = plan["gpus"]
    ddp_n, fsdp_n = next((run for run in ddp if run["gpus"] == n), None), by_kind("fsdp")
    fsdp = None
    if fsdp_n:
        ratio = (lambda key: fsdp_n[key] / ddp_n[key] if ddp_n and fsdp_n[key] is not None and ddp_n[key] else None)
        fsdp = {"gpus": n, "runs": {}, "tokens_per_s_ratio": ratio("median_tokens_per_s"),
                "memory_ratio": ratio("peak_mem_gb"),
                "max_abs_loss_diff": max_abs(loss_diffs(fsdp_n["losses"], ddp_n["losses"])) if ddp_n else None}
        for label, run in (("ddp", ddp_n), ("fsdp", fsdp_n)):
            if run:
                fsdp["runs"][label] = {key: run[key] for key in ("name", "status", "median_tokens_per_s",
                                                                   "median_step_ms", "peak_mem_gb")}
    large_run = by_kind("large")
    large = None
    if large_run:
        params, tps = large_run["parameters"], large_run["median_tokens_per_s"]
        large = {key: large_run[key] for key in ("name", "gpus", "status", "batch_size", "grad_accum", "shape",
                                                 "median_tokens_per_s", "median_step_ms", "median_mfu", "peak_mem_gb",
                                                 "parameters", "out_of_memory_at")}
        large["tokens_per_s_per_gpu"] = tps / large_run["gpus"] if tps is not None else None
        large["ddp_state_gb"] = STATE_BYTES_PER_PARAM * params / 1e9 if params else None
    resume_run = by_kind("resume")
    resume = None
    if resume_run:
        source = runs[resume_run["from_run"]]
        diffs = loss_diffs(resume_run["losses"], source["losses"])
        status = resume_run["status"]
        if status == "ok" and min(resume_run["losses"], default=None) != resume_run["from_step"]:
            status = resume_run["status"] = f"did not continue at step {resume_run['from_step']}"  # a fresh start
        resume = {"written_on": source["gpus"], "resumed_on": resume_run["gpus"], "from_step": resume_run["from_step"],
                  "steps_compared": list(diffs), "loss_diff": diffs, "max_abs_loss_diff": max_abs(diffs),
                  "status": status}
    for run in runs.values():
        run.pop("losses")
    return {"env": plan["env"], "gpus": n, "gpu": plan["env"].get("gpu"), "settings": plan["settings"],
            "skip_steps": skip_steps, "runs": runs, "scaling": scaling, "fsdp": fsdp, "large": large,
            "resume": resume}


def markdown(summary: dict) -> str:
    n, settings = summary["gpus"], summary["settings"]
    where = f"{n} x {summary['gpu']}" if summary["gpu"] else f"{n} CPU processes (gloo): a rehearsal, not numbers"
    lines = [f"# Scaling on {where}", "",
             f"{settings['model']}; {settings['per_gpu']} per GPU per step; global batch {settings['global_batch']:,} "
             f"tokens at every n (1 GPU accumulates). Medians of tokens/s over steps after the first "
             f"{summary['skip_steps']} (and train.py's warmup steps). Peak memory: rank 0's "
             "torch.cuda.max_memory_allocated, GB.", ""]
    lines += ["## Data parallel (DDP) against 1 GPU", "", markdown_table(
        ["GPUs", "accumulation", "tokens/s", "tokens/s per GPU", "scaling efficiency",
         "efficiency against 1 GPU's own step", "max |loss - 1 GPU's|", "last step's loss - 1 GPU's", "peak memory",
         "status"],
        [[row["gpus"], row["grad_accum"], fmt(row["tokens_per_s"]), fmt(row["tokens_per_s_per_gpu"]),
          fmt(row["efficiency"]), fmt(row["efficiency_per_step"]), fmt(row["max_abs_loss_diff"]),
          fmt(row["last_loss_diff"]), fmt(row["peak_mem_gb"]), row["status"]] for row in summary["scaling"]])]
    single = next((run for run in summary["runs"].values() if run["kind"] == "single"), None)
    if single:
        micro = single["grad_accum"]
        batches = "one micro-batch" if micro == 1 else f"{micro} micro-batches"
        lines += [f"1 GPU's own step ({single['name']}: {batches} a step, the update every step, as each DDP "
                  f"rank takes them): {fmt(single['median_tokens_per_s'])} tokens/s, {single['status']}. Against it "
                  "the ranks lose only to the all-reduce; against the accumulating GPU also to the update, which it "
                  "takes n times less often.", ""]
    if summary["fsdp"]:
        fsdp = summary["fsdp"]
        lines += [f"## FSDP2 beside DDP at {n} GPUs", "", markdown_table(
            ["strategy", "tokens/s", "ms/step", "peak memory per GPU", "status"],
            [[label, fmt(run["median_tokens_per_s"]), fmt(run["median_step_ms"]), fmt(run["peak_mem_gb"]),
              run["status"]] for label, run in fsdp["runs"].items()]),
            f"FSDP2 / DDP: tokens/s {fmt(fsdp['tokens_per_s_ratio'])}, peak memory {fmt(fsdp['memory_ratio'])}; "
            f"max |loss - DDP's| {fmt(fsdp['max_abs_loss_diff'])}.", ""]
    if summary["large"]:
        large = summary["large"]
        lines += [f"## The large model under FSDP2 at {n} GPUs", "", markdown_table(
            ["shape", "parameters", "micro-batch x accumulation", "tokens/s", "tokens/s per GPU", "MFU",
             "peak memory per GPU", "DDP's weights + grads + AdamW per GPU", "status"],
            [[large["shape"], f"{fmt(large['parameters'] / 1e9)}B" if large["parameters"] else "-",
              f"{large['batch_size']} x {large['grad_accum']}", fmt(large["median_tokens_per_s"]),
              fmt(large["tokens_per_s_per_gpu"]), fmt(large["median_mfu"]), fmt(large["peak_mem_gb"]),
              fmt(large["ddp_state_gb"]), large["status"]]])]
        if large["out_of_memory_at"]:
            lines += [f"A micro-batch of {', '.join(map(str, large['out_of_memory_at']))} ran out of memory first.", ""]
    if summary["resume"]:
        resume = summary["resume"]
        lines += ["## A checkpoint resumed on fewer GPUs", "", markdown_table(
            ["written on", "resumed on", "from step", "steps compared", "max |loss - the uninterrupted run's|",
             "status"],
            [[f"{resume['written_on']} GPUs", f"{resume['resumed_on']} GPU(s)", resume["from_step"],
              len(resume["steps_compared"]), fmt(resume["max_abs_loss_diff"]), resume["status"]]])]
    columns = [row for row in summary["scaling"] if row["gpus"] != 1 and row["loss_diff"]]
    if columns:
        steps = sorted({step for row in columns for step in row["loss_diff"]})
        lines += ["## Train loss, n GPUs minus 1 GPU, step by step", "", markdown_table(
            ["step", *(f"{row['gpus']} GPUs" for row in columns)],
            [[step, *(fmt(row["loss_diff"].get(step)) for row in columns)] for step in steps])]
    return "\n".join(lines)


def against(summary: dict, other: dict, source: str) -> dict:
    """This machine's large-model and FSDP2 figures beside another session's (issue 51: 4 GPUs against 2), each row
    naming its machine."""
    rows = []
    for where in (other, summary):
        machine = f"{where['gpus']} x {where.get('gpu') or 'CPU process'}"
        large, fsdp = where.get("large") or {}, ((where.get("fsdp") or {}).get("runs") or {}).get("fsdp", {})
        rows.append({"machine": machine, "gpus": where["gpus"],
                     "large_tokens_per_s": large.get("median_tokens_per_s"),
                     "large_tokens_per_s_per_gpu": large.get("tokens_per_s_per_gpu"),
                     "large_peak_mem_gb": large.get("peak_mem_gb"),
                     "fsdp_tokens_per_s": fsdp.get("median_tokens_per_s"), "fsdp_peak_mem_gb": fsdp.get("peak_mem_gb")})
    return {"source": source, "rows": rows}


def against_markdown(comparison: dict) -> str:
    return "\n".join([f"## FSDP2 against {comparison['source']}", "", markdown_table(
        ["machine", "large: tokens/s", "large: tokens/s per GPU", "large: peak memory per GPU", "GPT-2 124M: tokens/s",
         "GPT-2 124M: peak memory per GPU"],
        [[row["machine"], fmt(row["large_tokens_per_s"]), fmt(row["large_tokens_per_s_per_gpu"]),
          fmt(row["large_peak_mem_gb"]), fmt(row["fsdp_tokens_per_s"]), fmt(row["fsdp_peak_mem_gb"])]
         for row in comparison["rows"]])])


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    rows = [row for row in summary["scaling"] if row["tokens_per_s"]]
    if plt is None or not rows:
        return
    fig, (speed, losses) = plt.subplots(1, 2, figsize=(9, 3.2), gridspec_kw={"wspace": 0.35})
    one = next((row["tokens_per_s"] for row in rows if row["gpus"] == 1), None)
    gpus = [row["gpus"] for row in rows]
    speed.bar([str(n) for n in gpus], [row["tokens_per_s"] / 1e6 for row in rows], color="tab:blue", label="DDP")
    if one:
        speed.plot([str(n) for n in gpus], [n * one / 1e6 for n in gpus], "k--", marker="_", label="n x 1 GPU")
    speed.set(xlabel="GPUs", ylabel="M tokens/s", title=f"GPT-2 124M on {summary['gpu'] or 'CPU'}")
    speed.legend()
    for row in rows:
        if row["gpus"] != 1 and row["loss_diff"]:
            steps = sorted(row["loss_diff"], key=int)
            losses.plot([int(s) for s in steps], [row["loss_diff"][s] for s in steps], label=f"{row['gpus']} GPUs")
    losses.axhline(0, color="k", lw=0.5)
    losses.set(xlabel="step", ylabel="train loss - 1 GPU's", title="same global batch, same data")
    losses.legend()
    save_png(fig, path)


def write_report(out_dir: Path, skip_steps: int = DEFAULT_SKIP_STEPS, against_path: Path | None = None) -> dict:
    """results.json and results.md from out_dir's files; against_path: another session's results.json, whose FSDP2
    figures are set beside these (left out when it does not exist)."""
    summary = summarize(Path(out_dir), skip_steps)
    text = markdown(summary)
    if against_path and Path(against_path).exists():
        summary["against"] = against(summary, json.loads(Path(against_path).read_text()), str(against_path))
        text += "\n" + against_markdown(summary["against"])
    write_json(Path(out_dir) / "results.json", summary)
    (Path(out_dir) / "results.md").write_text(text)
    plot(summary, Path(out_dir) / "scaling.png")
    return summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path, help="the folder benchmarks/scaling.py wrote")
    p.add_argument("--skip_steps", type=int, default=DEFAULT_SKIP_STEPS,
                   help="steps at the start of each run left out of the medians")
    p.add_argument("--against", type=Path, help="another session's results.json (e.g. 2 GPUs): its FSDP2 figures "
                                                 "beside these")
    args = p.parse_args(argv)
    write_report(args.out_dir, args.skip_steps, args.against)
    print((args.out_dir / "results.md").read_text())


if __name__ == "__main__":
    main()
