"""Training comparison: the same train.py run once per variant (same seed, data order and steps), then
loss agreement and speed side by side. A variant is a name and the train.py flags that make it;
--backends is shorthand for one variant per attention backend, named after it.

    python -m benchmarks.compare --backends naive,compile,sdpa,triton -- configs/shakespeare.py --max_steps=300
    python -m benchmarks.compare --variants dense:attn=triton window:attn=triton,window=256 \\
        moba:attn=moba,moba_block=128,moba_topk=3 -- configs/shakespeare_sparse.py
    TRITON_INTERPRET=1 python -m benchmarks.compare --backends sdpa,triton --wandb=false -- configs/smoke_cpu.py  # CPU
    python -m benchmarks.compare --backends naive,sdpa,triton --seeds 1,2,3 -- configs/shakespeare.py   # seed spread

Everything after `--` goes to train.py unchanged (config files first, then --key=value flags), and each
variant's flags after it. Each run writes into <out_dir>/<run>/ (metrics.jsonl, train.log, run.json), the run
named after its variant (with --seeds, <variant>-seed<seed>), and logs to wandb with one group per comparison
and one run per run folder. The table and plot are then
made from those files alone by benchmarks/compare_report.py, which can be re-run on the folder.
"""
import argparse
import datetime
import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # run as `python benchmarks/compare.py`: make the repository root importable, as `-m` would
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.compare_report import default_reference, write_report
from benchmarks.report import environment, parse_bool, write_json
from training.config import ConfigError
from training.config import parse_args as parse_train_args
from training.distributed import World
from training.preflight import check_attention_device, pick_device

TRAIN_PY = Path(__file__).resolve().parents[1] / "train.py"
SET_PER_RUN = ("out_dir", "wandb_group", "wandb_run_name")
DEFAULT_BACKENDS = "naive,compile,sdpa,triton"
VARIANT_EXAMPLE = "e.g. window:attn=triton,window=256"


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'name:key=value,key=value' -> (name, {key: value}) of train.py flags; 'name:' adds none."""
    name, colon, flags = text.partition(":")
    if not colon or not re.fullmatch(r"[A-Za-z0-9][\w.-]*", name):
        raise ValueError(f"variant {text!r}: write name:key=value[,key=value...] with a name of letters, digits, "
                         f"_ . - (it names the run's folder and wandb run), {VARIANT_EXAMPLE}")
    settings = {}
    for item in filter(None, flags.split(",")):
        key, equals, value = item.partition("=")
        if not key or not equals:
            raise ValueError(f"variant {name!r}: {item!r} is not key=value, {VARIANT_EXAMPLE}")
        if key in SET_PER_RUN:
            raise ValueError(f"variant {name!r}: compare.py sets --{key} for each run itself (see its --out_dir/--group)")
        settings[key] = value
    return name, settings


def train_command(name: str, seed: int, run_dir: Path, args, train_args: list[str]) -> list[str]:
    """Config files first, then this comparison's defaults, then the user's flags (train.py applies
    them left to right, so the user's win), then what differs per run: the variant's flags and folders."""
    per_run = {*SET_PER_RUN, *(key for settings in args.variants.values() for key in settings)}
    for arg in train_args:
        key = arg[2:].partition("=")[0] if arg.startswith("--") else None
        if key in per_run:
            raise ValueError(f"compare.py sets --{key} per run (a variant sets it); drop {arg!r} (use --out_dir/--group "
                             "of compare.py, or put it in the variants)")
    configs = [a for a in train_args if not a.startswith("--")]
    flags = [a for a in train_args if a.startswith("--")]
    return [
        sys.executable, str(TRAIN_PY), *configs,
        f"--seed={seed}", f"--wandb={str(args.wandb).lower()}", f"--wandb_project={args.wandb_project}",
        *flags, *(f"--{key}={value}" for key, value in args.variants[name].items()),
        f"--out_dir={run_dir}", f"--wandb_group={args.group}", f"--wandb_run_name={run_dir.name}",
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
    runs = p.add_mutually_exclusive_group()
    runs.add_argument("--backends", help=f"comma-separated attention backends, one run each (default {DEFAULT_BACKENDS})")
    runs.add_argument("--variants", nargs="+", metavar="NAME:KEY=VALUE,...",
                      help=f"named runs, each with its train.py flags, {VARIANT_EXAMPLE}")
    p.add_argument("--out_dir", help="default out/compare-<date>-<time>/")
    p.add_argument("--group", help="wandb group of the runs (default: the out_dir's name)")
    p.add_argument("--reference", help="run the loss differences are measured against (default sdpa, else the first)")
    p.add_argument("--skip_steps", type=int, default=10, help="steps before this are left out of the speed medians")
    p.add_argument("--seed", type=int, default=1337, help="one seed for every run: same init, same data order")
    p.add_argument("--seeds", help="comma-separated seeds: every variant runs once per seed (the seed-to-seed "
                                   "spread that a difference between variants is judged against)")
    installed = importlib.util.find_spec("wandb") is not None
    p.add_argument("--wandb", type=parse_bool, default=installed,
                   help=f"log each run to wandb (default: {str(installed).lower()}, whether wandb is installed)")
    p.add_argument("--wandb_project", default="nanoflash")
    args = p.parse_args(ours)
    try:
        variants = ([parse_variant(v) for v in args.variants] if args.variants else
                    [(b, {"attn": b}) for b in (args.backends or DEFAULT_BACKENDS).split(",") if b])
    except ValueError as err:
        p.error(str(err))
    args.variants = dict(variants)
    if len(args.variants) < len(variants):
        p.error(f"two runs share a name: {[name for name, _ in variants]}; each needs its own folder")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    args.out_dir = Path(args.out_dir or Path("out") / f"compare-{stamp}").resolve()
    args.group = args.group or args.out_dir.name
    args.reference = args.reference or default_reference(args.variants)
    if args.reference not in args.variants:
        p.error(f"--reference {args.reference} is none of the runs: {', '.join(args.variants)}")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s] if args.seeds else [args.seed]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    return args, train_args


def runs_of(args) -> dict[str, tuple[str, int]]:
    """run folder name -> (variant, seed): one run per variant, or with several seeds one per variant and seed."""
    if len(args.seeds) == 1:
        return {name: (name, args.seeds[0]) for name in args.variants}
    return {f"{name}-seed{seed}": (name, seed) for name in args.variants for seed in args.seeds}


def main(argv=None) -> int:
    args, train_args = parse_args(sys.argv[1:] if argv is None else argv)
    if not TRAIN_PY.exists():
        raise SystemExit(f"{TRAIN_PY} not found: the comparison runs the trainer once per variant")
    env = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    runs = runs_of(args)
    commands = {run: train_command(name, seed, args.out_dir / run, args, train_args)
                for run, (name, seed) in runs.items()}
    for name, cmd in commands.items():  # before the first run starts: every run's settings, and that it runs here
        try:
            cfg = parse_train_args(cmd[2:])
            check_attention_device(cfg, pick_device(cfg, World()))
        except ConfigError as err:
            raise SystemExit(f"compare.py: run {name!r}: {err}") from None
    failed = []
    for i, (name, cmd) in enumerate(commands.items(), 1):
        run_dir = args.out_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"[{i}/{len(commands)}] {name}: {' '.join(cmd)}", flush=True)
        start = time.perf_counter()
        code = run_teed(cmd, run_dir / "train.log")
        variant, seed = runs[name]
        write_json(run_dir / "run.json", {
            "variant": variant, "seed": seed, "settings": args.variants[variant], "index": i, "group": args.group,
            "command": cmd,
            "train_args": train_args, "returncode": code, "wall_s": time.perf_counter() - start, "env": env,
        })
        if code != 0:
            failed.append(name)
            print(f"{name}: train.py exited with {code}; its output is in {run_dir / 'train.log'}", flush=True)
    reference = args.reference if len(args.seeds) == 1 else f"{args.reference}-seed{args.seeds[0]}"
    write_report(args.out_dir, reference, args.skip_steps)
    print((args.out_dir / "comparison.md").read_text())
    print(f"results in {args.out_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
