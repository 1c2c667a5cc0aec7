"""Multi-GPU scaling of train.py on one machine (issues 50 and 51): every run the table needs, in one call of a GPU
machine, then the table (benchmarks/scaling_report.py).

    python -m benchmarks.scaling                                   # every GPU of this machine -> out/scaling/
    python -m benchmarks.scaling --gpus 4 --out_dir out/results/scaling/h100x4 --budget_s 540
    python -m benchmarks.scaling --tiny --gpus 2 --resume_check    # the CPU rehearsal: gloo, a tiny GPT, seconds
    python -m benchmarks.scaling --gpus 2 --micro_steps 4 --ddp_only  # DDP as large batches run it: 4 micro-batches
    python -m benchmarks.scaling_report out/scaling                # redraw results.md from the runs' files

With N GPUs (torch.cuda.device_count(), or --gpus) it runs train.py, each run in <out_dir>/<run>/, in this order:

    ddp1         1 GPU (a plain process), accumulating micro-batches to the global batch of N GPUs
    single1      1 GPU, a rank's micro-batches a step: each DDP rank's work per step, its update included
    ddp2..ddpN   DDP under torchrun at 2, 4, ... N GPUs, the same global batch (accumulation where n < N)
    fsdpN        FSDP2 at N GPUs, the same model and batch: memory and tokens/s beside ddpN (not with --ddp_only)
    large-fsdpN  the large model (48 layers, 2560 wide, 20 heads: 3.9B parameters) under FSDP2 at N GPUs, a few steps
    resume-ddpN/2  where N >= 4 (or with --resume_check): ddpN writes a checkpoint --resume_steps before its end, and
                 this run resumes it at N/2 GPUs to ddpN's last step; its losses are compared with ddpN's

GPT-2 124M runs compiled with --attn=triton, 16 x 1024 tokens per GPU per micro-batch and --micro_steps (1)
micro-batches per GPU per step: the global batch is N x micro_steps x 16 x 1024 tokens, 1 GPU accumulating N x
micro_steps; DDP all-reduces on a step's last micro-batch only (nanoGPT's GPT-2 run takes 5 a GPU). The large model
runs --large_batch_size sequences per micro-batch (4: its activations at 16 would not fit) with accumulation to the
same tokens per GPU, uncompiled unless --large_compile. No evaluation, samples or final checkpoints
(--final_checkpoint=false): only timed steps.

Budget: one device call (the GPU runner gives a stage SECONDS_LEFT=560 s; --budget_s defaults to 540) holds the
plan of 2 or of 4 GPUs, with cold caches (what each run took: docs/perf_notes.md section 13). Each run's limit is the
time left (--budget_s from the start), at most --max_run_s (240), so that a hung run leaves time to the others; a run
that would start with less than --min_run_s left is recorded as not run. The report is rewritten after every run, so
whatever finished is in results.json whatever stops the rest.

The large model's memory per GPU at 2 GPUs, estimated: sharded fp32 weights 7.8 GB and AdamW moments 15.6 GB; during
accumulation FSDP2 keeps each block's gradient unsharded (train.py turns the reduce-scatter off on all but the last
micro-step, set_requires_gradient_sync(False)): 15.6 GB; activations at 4 x 1024 tokens ~19 GB and autocast's bf16
weight copies ~7.5 GB kept for the backward; the logits ~3 GB: ~70 GB of 80. A micro-batch that does not fit is
halved and the run started again (twice the accumulation, the same tokens per step), as time allows.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python benchmarks/scaling.py` works too

import torch

from benchmarks.report import default_out_dir, environment, write_json
from benchmarks.scaling_report import DEFAULT_SKIP_STEPS, write_report

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "shakespeare.py")  # GPT-2 124M, B=16, T=1024, tiny shakespeare
LARGE_SHAPE = dict(n_layer=48, n_embd=2560, n_head=20)
# --tiny: the same runs on the CPU, a few seconds each (gloo stands in for NCCL)
TINY = dict(device="cpu", attn="sdpa", compile=False, dtype="float32", n_layer=2, n_head=2, n_embd=32,
            block_size=32, batch_size=2)
TINY_LARGE_SHAPE = dict(n_layer=3, n_embd=64, n_head=4)
# what every run sets: only timed train steps, a record per step, no files but the metrics
EVERY_RUN = dict(eval_interval=0, sample_interval=0, log_interval=1, checkpoint_interval=0, final_checkpoint=False,
                 wandb=False)


@dataclass
class Run:
    name: str
    kind: str  # ddp | single | fsdp | large | resume
    gpus: int
    parallel: str
    batch_size: int
    grad_accum: int
    settings: dict  # train.py flags besides the config file
    shape: str = "GPT-2 124M"
    from_run: str | None = None  # resume: the run whose checkpoint it continues
    from_step: int | None = None
    extra: list = field(default_factory=list)  # the user's train.py flags, last


def gpu_counts(n: int) -> list[int]:
    """1, then 2, 4, ... up to n, and n itself: the DDP runs of a machine of n GPUs."""
    counts, k = [1], 2
    while k <= n:
        counts.append(k)
        k *= 2
    return counts if counts[-1] == n else counts + [n]


def plan(args) -> list[Run]:
    n = args.gpus
    base = dict(TINY) if args.tiny else dict(attn="triton", compile=True, batch_size=16)
    seq_len = base.get("block_size", 1024)
    per_gpu_seqs = base["batch_size"]
    micro = args.micro_steps
    global_batch = per_gpu_seqs * seq_len * n * micro
    steps = dict(max_steps=args.steps, warmup_steps=min(10, args.steps))
    common = {**base, **EVERY_RUN, "total_batch_size": global_batch, "dist_timeout": args.dist_timeout}
    ddp_only = {} if args.ddp_reduce_dtype == "float32" else {"ddp_reduce_dtype": args.ddp_reduce_dtype}
    resume = n >= 4 or args.resume_check
    runs = []
    for g in gpu_counts(n):
        settings = {**common, **steps, **ddp_only}
        if resume and g == n:  # its one checkpoint, resume_steps before the end; no checkpoint at the end
            settings["checkpoint_interval"] = args.steps - args.resume_steps
        runs.append(Run(f"ddp{g}", "ddp", g, "ddp", per_gpu_seqs, n // g * micro, settings))
        if g == 1:  # the same steps at one GPU's own batch: what a rank's step costs without the all-reduce
            runs.append(Run("single1", "single", 1, "ddp", per_gpu_seqs, micro,
                            {**settings, "total_batch_size": per_gpu_seqs * seq_len * micro}))
    if not args.ddp_only:
        runs.append(Run(f"fsdp{n}", "fsdp", n, "fsdp", per_gpu_seqs, micro, {**common, **steps, "parallel": "fsdp"}))
        shape = TINY_LARGE_SHAPE if args.tiny else LARGE_SHAPE
        large_batch = 1 if args.tiny else args.large_batch_size
        runs.append(Run(f"large-fsdp{n}", "large", n, "fsdp", large_batch, per_gpu_seqs // large_batch * micro,
                        {**common, **shape, "batch_size": large_batch,
                         "compile": args.large_compile and not args.tiny, "parallel": "fsdp",
                         "max_steps": args.large_steps, "warmup_steps": min(10, args.large_steps)},
                        shape=", ".join(f"{k} {v}" for k, v in shape.items())))
    if resume:
        half = max(n // 2, 1)
        runs.append(Run(f"resume-ddp{half}", "resume", half, "ddp", per_gpu_seqs, n // half * micro,
                        {**common, **steps, **ddp_only, "resume": True}, from_run=f"ddp{n}",
                        from_step=args.steps - args.resume_steps))
    for run in runs:
        run.extra = list(args.train_args)
    return runs


def command(run: Run, out_dir: Path) -> list[str]:
    flags = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in run.settings.items()]
    launcher = [] if run.gpus == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={run.gpus}"]
    return [sys.executable, *launcher, str(ROOT / "train.py"), CONFIG, *flags, *run.extra, f"--out_dir={out_dir}"]


def run_env(gpus: int) -> dict[str, str]:
    """This environment (NCCL's settings included), with the CPU's threads shared among the processes: torchrun
    gives each worker 1 thread unless OMP_NUM_THREADS is set, and one thread takes minutes to initialise the large
    model's 3.9B weights on the CPU (normal_ and nn.Linear's own init: ~5 s per 100M values)."""
    threads = str(max(1, (os.cpu_count() or 1) // gpus))
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}


def run_logged(cmd: list[str], log_path: Path, timeout: float, env: dict) -> tuple[int | None, bool]:
    """cmd with its output in log_path; past timeout its whole process group (torchrun and its workers) gets SIGTERM,
    then SIGKILL 15 s later. -> (exit status, whether it timed out)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return proc.returncode, True


def place_checkpoint(run: Run, out_dir: Path) -> str | None:
    """The checkpoint a resume run continues, linked (or copied) into its folder. -> why not, or None."""
    source = out_dir / run.from_run / "ckpt.pt"
    if not source.exists():
        return f"{run.from_run} left no checkpoint"
    target = out_dir / run.name / "ckpt.pt"
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy(source, target)
    return None


def parse_args(argv: list[str]):
    ours, train_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="python -m benchmarks.scaling [options] [-- train.py flags for every run]")
    p.add_argument("--gpus", type=int, help="GPUs to use, from 0 (default: torch.cuda.device_count()); with --tiny "
                                            "the number of CPU processes (default 2)")
    p.add_argument("--out_dir", type=Path, help="default out/scaling/")
    p.add_argument("--steps", type=int, default=30, help="steps of each GPT-2 124M run (default 30)")
    p.add_argument("--skip_steps", type=int, default=DEFAULT_SKIP_STEPS,
                   help=f"first steps of each run left out of the medians (default {DEFAULT_SKIP_STEPS})")
    p.add_argument("--large_steps", type=int, default=10, help="steps of the large model (default 10)")
    p.add_argument("--large_batch_size", type=int, default=4,
                   help="the large model's micro-batch; accumulation fills 16 sequences per GPU (default 4)")
    p.add_argument("--large_compile", action="store_true", help="compile the large model too (default: eager)")
    p.add_argument("--resume_steps", type=int, default=3,
                   help="steps the resume run takes from ddpN's checkpoint to ddpN's end (default 3)")
    p.add_argument("--resume_check", action="store_true", help="the resume run below 4 GPUs too (N -> N/2)")
    p.add_argument("--budget_s", type=float, default=540, help="seconds for all runs (default 540)")
    p.add_argument("--min_run_s", type=float, default=30, help="a run is not started with less time left (default 30)")
    p.add_argument("--max_run_s", type=float, default=240,
                   help="no run takes longer, so that a hung one leaves time to the rest (default 240)")
    p.add_argument("--dist_timeout", type=int, default=300, help="train.py's --dist_timeout (default 300)")
    p.add_argument("--against", type=Path, help="another session's results.json (e.g. 2 GPUs'): its FSDP2 figures "
                                                 "beside these in the report (ignored if missing)")
    p.add_argument("--tiny", action="store_true", help="the CPU rehearsal: a tiny GPT on CPU processes (gloo)")
    p.add_argument("--micro_steps", type=int, default=1,
                   help="micro-batches each GPU accumulates per step (default 1: the all-reduce every micro-batch)")
    p.add_argument("--ddp_only", action="store_true", help="only the DDP runs (no FSDP2, no large model)")
    p.add_argument("--ddp_reduce_dtype", choices=["float32", "bfloat16"], default="float32",
                   help="train.py's --ddp_reduce_dtype for the DDP runs (default float32)")
    args = p.parse_args(ours)
    args.train_args = train_args
    if args.gpus is None:
        args.gpus = 2 if args.tiny else torch.cuda.device_count()
    if args.gpus < 2:
        p.error(f"--gpus {args.gpus}: scaling needs at least 2 GPUs (torch sees {torch.cuda.device_count()})")
    if not 1 <= args.resume_steps <= args.steps // 2:
        p.error(f"--resume_steps must be from 1 to half of --steps ({args.steps // 2})")
    if args.micro_steps < 1:
        p.error(f"--micro_steps {args.micro_steps}: at least 1")
    if args.large_steps < 1 or 16 % args.large_batch_size:
        p.error("--large_steps must be at least 1 and --large_batch_size divide 16")
    args.out_dir = (args.out_dir or default_out_dir("scaling")).resolve()
    return args


def write_plan(args, runs: list[Run], env: dict) -> None:
    seqs, seq_len = runs[0].batch_size, runs[0].settings.get("block_size", 1024)
    model = "tiny GPT, CPU, fp32, sdpa" if args.tiny else "GPT-2 124M, compiled, --attn=triton, bf16"
    write_json(args.out_dir / "plan.json", {
        "env": env, "gpus": args.gpus,
        "settings": {"model": model, "per_gpu": f"{seqs} x {seq_len} tokens" + (
                         f" in each of {args.micro_steps} micro-batches" if args.micro_steps > 1 else ""),
                     "global_batch": runs[0].settings["total_batch_size"],  # ddp1's: every n's
                     "steps": args.steps, "large_steps": args.large_steps, "budget_s": args.budget_s,
                     "train_args": args.train_args},
        "runs": [{k: v for k, v in asdict(run).items() if k not in ("settings", "extra")} for run in runs],
    })


def out_of_memory(log: Path) -> bool:
    return log.exists() and "out of memory" in log.read_text(errors="replace")


def execute(run: Run, run_dir: Path, left: float, label: str) -> dict:
    """One run of train.py in run_dir with `left` seconds at most. -> what run.json records."""
    cmd = command(run, run_dir)
    print(f"{label} {run.name} ({left:.0f} s left): {' '.join(cmd)}", flush=True)
    began = time.monotonic()
    returncode, timed_out = run_logged(cmd, run_dir / "train.log", left, run_env(run.gpus))
    info = {"name": run.name, "command": cmd, "returncode": returncode, "timed_out": timed_out,
            "wall_s": time.monotonic() - began}
    print(f"{run.name}: exit {returncode}{' (timed out)' if timed_out else ''} in {info['wall_s']:.1f} s", flush=True)
    if returncode != 0:
        print("".join((run_dir / "train.log").read_text(errors="replace").splitlines(True)[-15:]), flush=True)
    return info


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.monotonic()
    runs = plan(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda"))
    env["gpu_count"] = torch.cuda.device_count()
    write_plan(args, runs, env)
    failed = 0
    for i, run in enumerate(runs, 1):
        label = f"[{i}/{len(runs)}]"
        run_dir = args.out_dir / run.name
        shutil.rmtree(run_dir, ignore_errors=True)  # a run's folder holds only this session's files
        run_dir.mkdir(parents=True)
        left = args.budget_s - (time.monotonic() - start)
        why_not = f"{left:.0f} s left" if left < args.min_run_s else None
        if why_not is None and run.from_run:
            why_not = place_checkpoint(run, args.out_dir)
        if why_not:
            print(f"{label} {run.name}: not run ({why_not})", flush=True)
            info = {"name": run.name, "command": command(run, run_dir), "returncode": None, "timed_out": False,
                    "wall_s": 0.0, "skipped": why_not}
        else:
            info = execute(run, run_dir, min(left, args.max_run_s), label)
        while (run.kind == "large" and info["returncode"] != 0 and not info["timed_out"] and run.batch_size > 1
               and out_of_memory(run_dir / "train.log")
               and (left := args.budget_s - (time.monotonic() - start)) >= args.min_run_s):
            # the large model's micro-batch did not fit: half of it, twice the accumulation, the same tokens a step
            (run_dir / "train.log").rename(run_dir / f"train.oom-batch{run.batch_size}.log")
            run.batch_size, run.grad_accum = run.batch_size // 2, run.grad_accum * 2
            run.settings["batch_size"] = run.batch_size
            write_plan(args, runs, env)
            info = {**execute(run, run_dir, min(left, args.max_run_s),
                              f"{label} out of memory; again at --batch_size={run.batch_size}:"),
                    "out_of_memory_at": info.get("out_of_memory_at", []) + [run.batch_size * 2]}
        failed += info["returncode"] != 0
        write_json(run_dir / "run.json", info)
        if run.from_run:  # the checkpoints served: none goes into the results
            for done in (args.out_dir / run.from_run / "ckpt.pt", run_dir / "ckpt.pt"):
                done.unlink(missing_ok=True)
        write_report(args.out_dir, args.skip_steps, args.against)
    print((args.out_dir / "results.md").read_text())
    print(f"results in {args.out_dir} ({time.monotonic() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
