"""GPT-2 training steps, one model per attention backend, timed side by side in one process.

    python -m benchmarks.train_step configs/shakespeare.py --backends sdpa,triton --rounds 5 --steps 20

Every backend builds the same model from train.py's config and flags (make_step: forward, backward, clip,
AdamW; nothing else), runs its warm-up steps (compilation, the kernels' tile tuning), and then the timed steps
run in rounds: each round gives every backend `--steps` steps in turn, each round in another order
(report.rotations), so a change of clocks or temperature during the run falls on all of them alike. Steps run as
train.py runs them, each queued before the previous one's results are read, so a step's time is what training gets:
the host's time to issue a step shows only where it exceeds the GPU's. Then a few steps per backend run under
torch.profiler, which splits the GPU time of a step into attention kernels, matmuls and the rest:
a difference in step time shows up as a difference in one of those, or (if the kernels' sum is well below
the step: GPU idle) as host time. Writes results.json and results.md to --out_dir.
"""
import argparse
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
from torch.profiler import ProfilerActivity, profile

from attention.flash import tuner
from benchmarks.report import environment, fmt, markdown_table, rotations, write_json
from model import GPT
from train import open_loader
from training.config import ConfigError, parse_args
from training.distributed import World
from training.preflight import pick_device, pick_dtype, set_tf32
from training.step import LaunchedStep, TrainStep

# GPU kernels by name. Ours are attn_fwd*/attn_bwd_* (the Hopper backward's pre- and post-pass too) and _moba_*;
# PyTorch's sdpa runs cuDNN ("cudnn ... sdpa"), FlashAttention ("flash") or memory-efficient ("fmha") kernels.
# Attention is matched first: cutlass names its fmha kernels too.
ATTENTION_NAMES = ("attn_", "moba", "flash", "fmha", "sdpa", "cudnn")
MATMUL_NAMES = ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "sm80_")


def kernel_category(name: str) -> str:
    lower = name.lower()
    if any(part in lower for part in ATTENTION_NAMES):
        return "attention"
    if any(part in lower for part in MATMUL_NAMES):
        return "matmul"
    return "other"


def make_step(cfg, world: World, compile_mode: str = "default", built: dict | None = None
              ) -> tuple[Callable[[], LaunchedStep], torch.device, torch.dtype]:
    """-> (step, device, dtype): step() queues one training step of a model built from cfg, train.py's step
    (training/step.py: forward and backward over the gradient-accumulation micro-batches, clip, the non-finite check
    as cfg.nonfinite says, AdamW), without syncing beyond the step's own. compile_mode: torch.compile's mode when
    cfg.compile ("reduce-overhead" replays CUDA graphs). built: models by their settings, so that runs which differ
    only in the training loop's settings (nonfinite) train one model and compile it once."""
    device = pick_device(cfg, world)
    dtype = pick_dtype(cfg, device)
    key = repr({**asdict(cfg), "nonfinite": None, "max_skipped_steps": None})
    if built is None or key not in built:
        torch.manual_seed(cfg.seed)
        set_tf32(cfg, device)
        raw_model = GPT(cfg.gpt_config()).to(device)
        optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2))
        model = torch.compile(raw_model, mode=compile_mode) if cfg.compile else raw_model
        loader = open_loader(cfg, "train", world, raw_model.config.vocab_size)
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        parts = (model, list(raw_model.parameters()), optimizer, scaler, loader.next_batch)  # a list: runs share it
        if built is not None:
            built[key] = parts
    else:
        parts = built[key]
    autocast = nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    train_step = TrainStep(*parts, autocast, device, cfg.grad_accum_steps(world.size), cfg.grad_clip, world.size,
                           no_sync=None, check_finite=cfg.nonfinite != "off")
    return lambda: train_step(cfg.learning_rate, False), device, dtype


def timed_steps(step: Callable[[], LaunchedStep], n: int) -> tuple[list[float], list[float]]:
    """(ms of each of n steps, ms the host took to queue each), run as train.py runs them: step i + 1 is queued
    before step i's results are read. A step's time is its span on the GPU's stream (LaunchedStep's events: the
    GPU's wait for the host inside the step counts, the host's lead does not); without a GPU, the wall time between
    two steps' results."""
    step_ms, host_ms, pending = [], [], None
    last = time.perf_counter()
    for i in range(n + 1):
        launched = None
        if i < n:
            t0 = time.perf_counter()
            launched = step()
            host_ms.append(1000 * (time.perf_counter() - t0))
        if pending is not None:
            device_ms, now = pending.wait().device_ms, time.perf_counter()
            step_ms.append(device_ms if device_ms is not None else 1000 * (now - last))
            last = now
        pending = launched
    return step_ms, host_ms


def gpu_time_per_step(step, device: torch.device, n_steps: int, trace: Path | None = None) -> dict:
    """GPU kernel time of one step (mean over n_steps), ms by category, and the attention kernels by name;
    busy_ms: the time at least one kernel ran (kernels of different streams can overlap), so that the
    profiled steps' wall_ms - busy_ms is the time the GPU sat idle, waiting for the host."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        timed_steps(step, n_steps)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall_ms = 1000 * (time.perf_counter() - t0) / n_steps
    if trace is not None:  # for chrome://tracing or ui.perfetto.dev: where the GPU waits, and on what
        prof.export_chrome_trace(str(trace))
    by_category = {"attention": 0.0, "matmul": 0.0, "other": 0.0}
    attention_kernels: dict[str, dict] = {}
    intervals = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        intervals.append((event.time_range.start, event.time_range.end))
        ms = event.time_range.elapsed_us() / 1000 / n_steps
        category = kernel_category(event.name)
        by_category[category] += ms
        if category == "attention":
            entry = attention_kernels.setdefault(event.name[:120], {"ms": 0.0, "calls": 0.0})
            entry["ms"] += ms
            entry["calls"] += 1 / n_steps
    busy_us, covered_to = 0.0, float("-inf")
    for start, end in sorted(intervals):  # the length of the union of the kernels' intervals
        busy_us += max(0.0, end - max(start, covered_to))
        covered_to = max(covered_to, end)
    return dict(wall_ms=wall_ms, busy_ms=busy_us / 1000 / n_steps, kernels_ms=sum(by_category.values()),
                by_category_ms=by_category,
                attention_kernels=dict(sorted(attention_kernels.items(), key=lambda kv: -kv[1]["ms"])))


def tuner_choices(log: list[dict]) -> list[dict]:
    """tuner.tuning_log as JSON: per tuned kernel and shape, its candidates (as text), fastest first. At
    GPT-2's shape the `tl` and Hopper kernels can be within the tuner's noise of each other, so this says which ran."""
    return [dict(kernel=entry["kernel"], shape=str(entry.get("key", (entry.get("Tq"), entry.get("Tk")))),
                 times_ms=dict(sorted(((_label(choice), ms) for choice, ms in entry["times_ms"].items()),
                                      key=lambda item: item[1])))
            for entry in log]


def _label(choice) -> str:
    return "tl" if choice is None else str(choice)  # the backward's None is the `tl` kernels


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backends", default="sdpa,triton",
                   help="comma-separated runs: an --attn value, or name:key=value+key=value for train.py flags, "
                        "e.g. unchecked:attn=triton+nonfinite=off (runs that differ only in nonfinite share a model)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per backend first (compiling, tuning)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="timed steps per backend per round")
    p.add_argument("--profile_steps", type=int, default=3, help="steps per backend under torch.profiler (0: none)")
    p.add_argument("--compile_mode", default="default", choices=("default", "reduce-overhead"),
                   help="torch.compile mode; reduce-overhead replays CUDA graphs, so the host's time to issue a "
                        "step no longer counts")
    p.add_argument("--trace", action="store_true", help="also write each backend's profiled steps as trace_<backend>.json")
    p.add_argument("--out_dir", default="out/train_step", help="where results.json and results.md go")
    args, train_argv = p.parse_known_args(argv)

    world = World()
    steps, cfgs, built = {}, {}, {}
    log_before, tuner.tuning_log = tuner.tuning_log, []  # what the tuner chose in the warm-up steps
    for run in args.backends.split(","):
        name, _, flags = run.partition(":")
        flags = [f"--{flag}" for flag in flags.split("+") if flag] or [f"--attn={name}"]
        cfgs[name] = parse_args([*train_argv, *flags, "--wandb=false"])
        steps[name], device, dtype = make_step(cfgs[name], world, args.compile_mode, built)
        timed_steps(steps[name], args.warmup)
    step_ms, host_ms = {name: [] for name in steps}, {name: [] for name in steps}
    for order in rotations(list(steps), args.rounds):
        for name in order:
            times, issue = timed_steps(steps[name], args.steps)
            step_ms[name] += times
            host_ms[name] += issue

    cfg = next(iter(cfgs.values()))
    tokens = cfg.batch_size * cfg.block_size * cfg.grad_accum_steps(world.size)
    results = {"environment": environment(device), "dtype": str(dtype).removeprefix("torch."),
               "settings": dict(model=cfg.model, batch_size=cfg.batch_size, block_size=cfg.block_size,
                                tokens_per_step=tokens, compile=cfg.compile, compile_mode=args.compile_mode,
                                warmup=args.warmup,
                                rounds=args.rounds, steps=args.steps, profile_steps=args.profile_steps),
               "backends": {}}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, step in steps.items():
        median = statistics.median(step_ms[name])
        # host: the time to queue a step; near the step's own time, the host and not the GPU sets the pace. Each
        # step's ms kept to the microsecond, about a CUDA event's resolution (the repository keeps these files)
        results["backends"][name] = dict(median_ms=median, min_ms=min(step_ms[name]), tokens_per_s=tokens / median * 1e3,
                                         host_ms=statistics.median(host_ms[name]),
                                         step_ms=[round(ms, 3) for ms in step_ms[name]])
        if args.profile_steps:
            trace = out_dir / f"trace_{name}.json" if args.trace else None
            results["backends"][name]["profile"] = gpu_time_per_step(step, device, args.profile_steps, trace)

    results["tuning"] = tuner_choices(tuner.tuning_log)
    tuner.tuning_log = log_before
    write_json(out_dir / "results.json", results)
    (out_dir / "results.md").write_text(report(results))
    print(report(results))
    return results


def report(results: dict) -> str:
    env, s = results["environment"], results["settings"]
    backends = results["backends"]
    first = next(iter(backends))
    rows = []
    for name, r in backends.items():
        prof = r.get("profile", {})
        cat = prof.get("by_category_ms", {})
        idle = prof["wall_ms"] - prof["busy_ms"] if prof else None
        rows.append([name, fmt(r["median_ms"]), fmt(r["min_ms"]), fmt(r["host_ms"]), f"{r['tokens_per_s']:,.0f}",
                     fmt(backends[first]["median_ms"] / r["median_ms"]), fmt(prof.get("kernels_ms")),
                     fmt(cat.get("attention")), fmt(cat.get("matmul")), fmt(cat.get("other")), fmt(idle)])
    lines = [
        "# Training step by attention backend\n",
        f"{env['gpu'] or env['device']}, torch {env['torch']}, triton {env['triton']}, {results['dtype']}, "
        f"{env['date']}. {s['model']}, B={s['batch_size']}, T={s['block_size']} ({s['tokens_per_step']:,} tokens "
        f"per step), compile={s['compile']} (mode {s.get('compile_mode', 'default')}). Median of {s['rounds']} rounds "
        f"x {s['steps']} steps per backend, "
        f"rounds interleaved with the order rotating, after {s['warmup']} warm-up steps; each step queued before the "
        f"previous one's results are read, as train.py runs them, and timed by its span on the GPU's stream; host: "
        f"median time to queue a step; GPU kernel time per step from torch.profiler "
        f"over {s['profile_steps']} steps (attention / matmul / other by kernel name; idle: the profiled steps' "
        f"wall time in which no kernel ran).\n",
        markdown_table(["backend", "median ms/step", "min ms", "host ms", "tokens/s", f"speed vs {first}", "GPU kernels ms",
                        "attention ms", "matmul ms", "other ms", "GPU idle ms"], rows),
    ]
    for name, r in backends.items():
        kernels = r.get("profile", {}).get("attention_kernels", {})
        if kernels:
            lines.append(f"\nAttention kernels, {name} (per step):\n")
            lines.append(markdown_table(["kernel", "ms", "calls"],
                                        [[f"`{k}`", fmt(v["ms"]), fmt(v["calls"])] for k, v in kernels.items()]))
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        main()
    except ConfigError as err:
        sys.exit(f"train_step: error: {err}")
