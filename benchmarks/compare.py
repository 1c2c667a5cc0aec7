"""Training comparison: the same train.py run once per attention backend (same seed, data order and
steps), then loss agreement and speed side by side.

    python -m benchmarks.compare --backends naive,compile,sdpa,triton -- configs/shakespeare.py --max_steps=300
    python -m benchmarks.compare --backends sdpa,triton --wandb=false -- configs/smoke_cpu.py

Everything after `--` goes to train.py unchanged (config files first, then --key=value flags). Each run
writes into <out_dir>/<backend>/ (metrics.jsonl, train.log, run.json) and logs to wandb with one group
per comparison and one run per backend. The table and plot are then made from those files alone by
benchmarks/compare_report.py, which can be re-run on the folder.
"""
import argparse
import datetime
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # run as `python benchmarks/compare.py`: make the repository root importable, as `-m` would
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.compare_report import write_report
from benchmarks.report import environment, parse_bool, write_json

TRAIN_PY = Path(__file__).resolve().parents[1] / "train.py"
SET_PER_BACKEND = ("attn", "out_dir", "wandb_group", "wandb_run_name")


def train_command(backend: str, run_dir: Path, args, train_args: list[str]) -> list[str]:
    """Config files first, then this comparison's defaults, then the user's flags (train.py applies
    them left to right, so the user's win), then what must differ per backend."""
    for arg in train_args:
        key = arg[2:].partition("=")[0] if arg.startswith("--") else None
        if key in SET_PER_BACKEND:
            raise ValueError(f"compare.py sets --{key} for each backend itself; drop {arg!r} (use --out_dir/--group of compare.py)")
    configs = [a for a in train_args if not a.startswith("--")]
    flags = [a for a in train_args if a.startswith("--")]
    return [
        sys.executable, str(TRAIN_PY), *configs,
        f"--seed={args.seed}", f"--wandb={str(args.wandb).lower()}", f"--wandb_project={args.wandb_project}",
        *flags,
        f"--attn={backend}", f"--out_dir={run_dir}", f"--wandb_group={args.group}", f"--wandb_run_name={backend}",
    ]


def run_teed(cmd: list[str], log_path: Path) -> int:
    """Run cmd, showing its output live and keeping a copy in log_path; returns its exit code."""
    with open(log_path, "wb") as log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        # raw chunks, not lines: progress bars redraw with \r and would otherwise become one line per update
        for chunk in iter(lambda: proc.stdout.read1(1 << 16), b""):
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            log.write(chunk)
    return proc.returncode


def parse_args(argv: list[str]):
    ours, train_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python -m benchmarks.compare [options] -- [train.py config files and --key=value flags]",
    )
    p.add_argument("--backends", default="naive,compile,sdpa,triton", help="comma-separated attention backends")
    p.add_argument("--out_dir", help="default benchmarks/results/compare-<date>-<time>/")
    p.add_argument("--group", help="wandb group of the runs (default: the out_dir's name)")
    p.add_argument("--reference", help="backend the loss differences are measured against (default sdpa, else the first)")
    p.add_argument("--skip_steps", type=int, default=10, help="steps before this are left out of the speed medians")
    p.add_argument("--seed", type=int, default=1337, help="one seed for every run: same init, same data order")
    installed = importlib.util.find_spec("wandb") is not None
    p.add_argument("--wandb", type=parse_bool, default=installed,
                   help=f"log each run to wandb (default: {str(installed).lower()}, whether wandb is installed)")
    p.add_argument("--wandb_project", default="nanoflash")
    args = p.parse_args(ours)
    args.backends = [b for b in args.backends.split(",") if b]
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    args.out_dir = Path(args.out_dir or Path(__file__).parent / "results" / f"compare-{stamp}").resolve()
    args.group = args.group or args.out_dir.name
    args.reference = args.reference or ("sdpa" if "sdpa" in args.backends else args.backends[0])
    return args, train_args


def main(argv=None) -> int:
    args, train_args = parse_args(sys.argv[1:] if argv is None else argv)
    if not TRAIN_PY.exists():
        raise SystemExit(f"{TRAIN_PY} not found: the comparison runs the trainer once per backend")
    env = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    commands = {b: train_command(b, args.out_dir / b, args, train_args) for b in args.backends}  # checks before any run
    failed = []
    for i, (backend, cmd) in enumerate(commands.items(), 1):
        run_dir = args.out_dir / backend
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"[{i}/{len(commands)}] {backend}: {' '.join(cmd)}", flush=True)
        start = time.perf_counter()
        code = run_teed(cmd, run_dir / "train.log")
        write_json(run_dir / "run.json", {
            "backend": backend, "group": args.group, "command": cmd, "train_args": train_args,
            "returncode": code, "wall_s": time.perf_counter() - start, "env": env,
        })
        if code != 0:
            failed.append(backend)
            print(f"{backend}: train.py exited with {code}; its output is in {run_dir / 'train.log'}", flush=True)
    write_report(args.out_dir, args.reference, args.skip_steps)
    print((args.out_dir / "comparison.md").read_text())
    print(f"results in {args.out_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
