"""Attention kernel benchmark: every backend side by side on one GPU, forward, backward and both.

    python -m benchmarks.attention                       # full grid, bf16 -> out/kernels/
    python -m benchmarks.attention --quick               # a few shapes
    python -m benchmarks.attention --backends sdpa,triton --seq_lens 1024,4096 --head_dims 64
    python -m benchmarks.attention --resume --out_dir D  # go on where a run that was cut off stopped
    python -m benchmarks.attention --device cpu          # toy shapes with a wall-clock timer (tests)

It writes the raw measurements to results.json after every shape; the CSV, markdown tables and plots are
then made from that file alone (benchmarks/attention_report.py, which can be re-run on its own).
"""
import argparse
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, astuple, dataclass
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # run as `python benchmarks/attention.py`: Python put benchmarks/ first on sys.path, where this
    # very file would shadow the attention package; look in the repository root instead
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

if not torch.cuda.is_available():
    # Triton reads this when it is imported: without a GPU our kernel can only run in its CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton.testing
from tqdm import tqdm

from attention import attention
from attention.flash import tuner
from attention.flash.native import wait as native_launcher_built
from benchmarks.attention_report import write_report
from benchmarks.report import default_out_dir, environment, measured, parse_bool, rotations, write_json

PASSES = ("fwd", "bwd", "fwd+bwd")
# The backward pass does 5 matmuls of the forward's size (S recomputed, dV, dP, dQ, dK) against the
# forward's 2 (S = QK^T, O = PV): 2.5x the forward's FLOPs, so forward+backward is 3.5x.
PASS_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def attention_flops(B: int, nh: int, T: int, hs: int, causal: bool, pass_: str) -> float:
    """FLOPs of one pass over (B, nh, T, hs) inputs, counting a multiply-add as 2."""
    flops = 4 * B * nh * T * T * hs  # QK^T and PV: each 2 * T * T * hs per head
    if causal:
        flops /= 2  # only the lower triangle is needed; every flash kernel skips the rest
    return flops * PASS_FLOP_FACTOR[pass_]


# ----------------------------------------------------------------------------------------------
# shapes


@dataclass(frozen=True)
class Shape:
    B: int
    nh: int
    T: int
    hs: int
    causal: bool
    group: str  # "gpt2": the model's own shape; "grid": the sweep that the plots are drawn from

    def __str__(self):
        return f"B={self.B} nh={self.nh} T={self.T} hs={self.hs} {'causal' if self.causal else 'full'}"


GPT2_SHAPE = Shape(B=16, nh=12, T=1024, hs=64, causal=True, group="gpt2")
# A grid keeps B*T tokens and nh*hs model width fixed, so every cell does the same projection work
# and only the attention's T^2 term grows.
GRIDS = {
    "full": dict(seq_lens=[1024, 2048, 4096, 8192, 16384], head_dims=[64, 128], tokens=16384, width=2048, gpt2=True),
    "quick": dict(seq_lens=[1024, 4096], head_dims=[64], tokens=16384, width=2048, gpt2=True),
    "toy": dict(seq_lens=[32, 64], head_dims=[16, 32], tokens=128, width=64, gpt2=False),
}


def grid_shapes(seq_lens, head_dims, causals, tokens: int, width: int, batch: int | None = None) -> list[Shape]:
    """Shapes of nh*hs = width; B*T = tokens, or B = batch when given (memory then grows with T)."""
    shapes = []
    for hs in head_dims:
        if width % hs:
            raise ValueError(f"--width {width} is not a multiple of head dim {hs}; pick head dims that divide it")
        for causal in causals:
            for T in seq_lens:
                if batch is None and tokens % T:
                    raise ValueError(f"--tokens {tokens} is not a multiple of T={T}; use powers of two up to --tokens")
                shapes.append(Shape(batch or tokens // T, width // hs, T, hs, causal, "grid"))
    return shapes


# ----------------------------------------------------------------------------------------------
# backends: fn(q, k, v, causal) -> out. The registry's own backends plus views of sdpa and flex that
# only a benchmark needs.

SDPA_KERNELS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION"}


def registry_backend(name: str):
    return lambda q, k, v, causal: attention(q, k, v, causal=causal, backend=name)


def forced_sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = getattr(SDPBackend, SDPA_KERNELS[name])

    def run(q, k, v, causal):
        # the kernel is chosen in the forward; its backward follows it, so the context can close here
        with sdpa_kernel(kernel):
            return attention(q, k, v, causal=causal, backend="sdpa")

    return run


def flex_backend(name: str):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)  # uncompiled flex_attention is a slow reference, not the kernel

    @functools.lru_cache(maxsize=4)  # built once per shape, outside the timed calls
    def causal_block_mask(Tq: int, Tk: int, device: str):
        def visible(b, h, q_idx, kv_idx):  # bottom-right aligned, as attention/masks.py
            return kv_idx <= q_idx + (Tk - Tq)

        return create_block_mask(visible, B=None, H=None, Q_LEN=Tq, KV_LEN=Tk, device=device)

    def run(q, k, v, causal):
        block_mask = causal_block_mask(q.shape[2], k.shape[2], str(q.device)) if causal else None
        return compiled(q, k, v, block_mask=block_mask)

    return run


BACKENDS = {
    "naive": registry_backend,
    "compile": registry_backend,
    "sdpa": registry_backend,  # PyTorch's own pick of kernel
    "sdpa-flash": forced_sdpa_backend,
    "sdpa-cudnn": forced_sdpa_backend,
    "sdpa-efficient": forced_sdpa_backend,
    "flex": flex_backend,
    "triton": registry_backend,  # ours
    "cuda": registry_backend,  # ours in CUDA C++ (attention/cuda/), built on its first call
}
DEFAULT_BACKENDS = {"cuda": list(BACKENDS), "cpu": ["naive", "compile", "sdpa"]}

# Rough bytes per (Tq, Tk) score element alive at the fwd+bwd peak of the backends that materialise
# the score matrix, given the input's element size: naive keeps ~3 fp32 copies (scores, softmax,
# its gradient) and ~2 in the input dtype; compile fuses scale/mask/softmax into one fp32 pass.
SCORE_BYTES = {"naive": lambda itemsize: 12 + 2 * itemsize, "compile": lambda itemsize: 4 + 2 * itemsize}


def score_memory_skip_reason(backend: str, shape: Shape, itemsize: int, free_bytes: int | None) -> str | None:
    """Why `backend` cannot run `shape` in `free_bytes`, or None if it may try (an OOM is still caught)."""
    if backend not in SCORE_BYTES or free_bytes is None:
        return None
    need = shape.B * shape.nh * shape.T * shape.T * SCORE_BYTES[backend](itemsize)
    if need <= free_bytes:
        return None
    return f"skipped: the T^2 score matrix needs ~{need / 2**30:.0f} GiB, {free_bytes / 2**30:.0f} GiB free"


def free_memory_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None  # toy shapes only on CPU
    torch.cuda.empty_cache()  # blocks cached by earlier shapes are free for this one
    return torch.cuda.mem_get_info(device)[0]


# ----------------------------------------------------------------------------------------------
# timing and memory


def median_ms(step, grads, device: torch.device, rep_ms: float) -> float:
    if device.type == "cuda":
        # CUDA-event timing of many calls, L2 flushed between them; grads reset so every backward allocates
        return triton.testing.do_bench(step, rep=rep_ms, grad_to_none=grads, return_mode="median")
    # do_bench needs a GPU. On CPU: wall-clock median of at least 3 calls filling rep_ms (rough, no cache flush)
    times, deadline = [], time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or time.perf_counter() < deadline:
        for t in grads:
            t.grad = None
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def warm_up_gpu(device: torch.device, seconds: float = 2.0) -> None:
    """Matmuls back to back for a while: an idle GPU clocks down, and without this the first cells of a run are
    timed while its clock comes back up."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize(device)


def pass_step(fn, pass_: str, q, k, v, dout, causal: bool):
    """The callable to time for one pass. The forward runs with autograd on, as in training."""
    if pass_ == "fwd":
        return lambda: fn(q, k, v, causal)
    # torch.autograd.grad, not .backward(): accumulating into .grad would add an elementwise kernel whose
    # cost depends on the backend's gradient layout (ours are (B, T, H, D) strided), not on attention;
    # training zeroes grads to None, so the first write is an assignment there too
    if pass_ == "bwd":
        out = fn(q, k, v, causal)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), dout)


def peak_memory_gib(fn, q, k, v, dout, causal: bool) -> float:
    """Peak allocated during one fwd+bwd beyond what was allocated before it (q, k, v, dout): the
    output, saved activations, workspace and dq, dk, dv."""
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(q, k, v, causal).backward(dout)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def failure(e: Exception) -> str:
    if isinstance(e, torch.OutOfMemoryError):
        return "skipped: out of memory"
    return f"error: {first_line(e)}"


def inputs_of(B: int, nh: int, T: int, hs: int, dtype, device, layout: str = "contiguous") -> tuple:
    """q, k, v (B, nh, T, hs) leaves that require grad, and dO: contiguous, or with layout "model" as a model's fused
    qkv projection leaves them (transposed views of one (B, T, 3, nh, hs) tensor, none contiguous)."""
    if layout == "model":
        packed = torch.randn(B, T, 3, nh, hs, device=device, dtype=dtype)
        q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in packed.unbind(2))
    else:
        q, k, v = (torch.randn(B, nh, T, hs, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(B, nh, T, hs, device=device, dtype=dtype)


def measure(fns: dict, shape: Shape, passes_of: dict[str, list[str]], dtype, device, rep_ms: float,
            rounds: int = 1, layout: str = "contiguous") -> dict[str, dict[str, dict]]:
    """name -> pass -> {"ms", "tflops", "peak_mem_gib", "status"} for backends fns (name -> fn) on one shape, side by
    side. Every (backend, pass) first runs once (compilation and autotuning happen there, outside the timing); then
    `rounds` rounds time each once (median_ms), each round starting further along and in another order (rotations),
    and a cell's ms is the median of its rounds. Timed one after the other, a kernel runs at the clock the one before
    left the GPU (under a power cap, a kernel that draws more lowers it for the next), so a fixed order would favour
    whichever backend goes first, or after the lightest. layout: the inputs' (inputs_of)."""
    cells = {name: {} for name in fns}
    inputs, steps = {}, []  # steps: the (name, pass) that ran their warm-up
    for name, fn in fns.items():
        inputs[name] = inputs_of(shape.B, shape.nh, shape.T, shape.hs, dtype, device, layout)
        for pass_ in passes_of[name]:
            try:
                pass_step(fn, pass_, *inputs[name], shape.causal)()
                steps.append((name, pass_))
            except Exception as e:  # a backend rejecting a shape is a result to record, not a crash
                cells[name][pass_] = failed_cell(e, device)
    times = {key: [] for key in steps}
    for order in rotations(steps, rounds):
        for name, pass_ in order:
            if pass_ in cells[name]:  # failed in an earlier round
                continue
            try:
                step = pass_step(fns[name], pass_, *inputs[name], shape.causal)
                times[(name, pass_)].append(median_ms(step, inputs[name][:3], device, rep_ms))
            except Exception as e:
                cells[name][pass_] = failed_cell(e, device)
    for (name, pass_), ts in times.items():
        if pass_ in cells[name]:
            continue
        ms = statistics.median(ts)
        flops = attention_flops(shape.B, shape.nh, shape.T, shape.hs, shape.causal, pass_)
        ms = measured(ms)
        cell = {"ms": ms, "tflops": measured(flops / (ms * 1e-3) / 1e12), "peak_mem_gib": None, "status": "ok"}
        if pass_ == "fwd+bwd" and device.type == "cuda":
            try:
                cell["peak_mem_gib"] = measured(peak_memory_gib(fns[name], *inputs[name], shape.causal))
            except Exception as e:
                cell = failed_cell(e, device)
        cells[name][pass_] = cell
    return {name: {p: cells[name][p] for p in passes_of[name]} for name in fns}  # in the order of passes_of


def empty_cell(status: str) -> dict:
    """A cell with no measurement: skipped or failed, status saying why."""
    return {"ms": None, "tflops": None, "peak_mem_gib": None, "status": status}


def failed_cell(e: Exception, device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return empty_cell(failure(e))


# ----------------------------------------------------------------------------------------------
# the run


def run(args) -> Path:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    shapes = ([GPT2_SHAPE] if args.gpt2 else []) + grid_shapes(
        args.seq_lens, args.head_dims, args.causal, args.tokens, args.width, args.batch
    )
    out_dir = Path(args.out_dir or default_out_dir("kernels"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.json"
    env, rows = environment(device), []
    if args.resume and results_path.exists():
        earlier = json.loads(results_path.read_text())
        # one table must come from one setup: refuse to mix in cells from another GPU, dtype or version
        then = {"dtype": earlier["settings"]["dtype"], **{k: earlier["env"][k] for k in ("gpu", "torch", "triton")}}
        now = {"dtype": args.dtype, **{k: env[k] for k in ("gpu", "torch", "triton")}}
        if then != now:
            raise SystemExit(f"{results_path} was measured with {then}, this run has {now}; use another --out_dir")
        rows = earlier["rows"]
    done = {(r["backend"], r["B"], r["nh"], r["T"], r["hs"], r["causal"], r["pass"]) for r in rows}

    results = {
        "env": env,
        "settings": {
            "dtype": args.dtype,
            "passes": args.passes,
            "timer": "triton.testing.do_bench median, CUDA events" if device.type == "cuda"
            else "time.perf_counter median on CPU (rough: no cache flush, no GPU)",
            "rep_ms": args.rep_ms,
            "rounds": args.rounds,
            "memory": "peak allocated during one fwd+bwd minus the allocated inputs q, k, v, dout (null on CPU)",
            "flops": "4*B*nh*T*T*hs per forward, /2 when causal, x2.5 backward, x3.5 forward+backward",
            "compile": "torch._dynamo.reset() before every shape: each shape compiles static, as a fixed-T training run",
        },
        "rows": rows,
    }
    factories = {}
    for name in args.backends:
        try:
            factories[name] = BACKENDS[name](name)
        except Exception as e:  # e.g. FlexAttention missing from an older torch
            factories[name] = f"skipped: backend unavailable ({first_line(e)})"

    if device.type == "cuda":
        warm_up_gpu(device)
        if "triton" in args.backends:
            # eager calls launch from C++ once its build (in the background, from a process's first repeated call)
            # lands, as in any process that runs for a minute: every timed cell has it, the first one included
            native_launcher_built()
    bar = tqdm(total=len(shapes) * len(args.backends), unit="cell")
    for shape in shapes:
        # A fresh Dynamo per shape: the compiled backends never reach the recompile limit over the grid,
        # and every shape gets static-shape kernels, as a training run at one fixed T would.
        torch._dynamo.reset()
        free = free_memory_bytes(device)
        bar.set_postfix_str(str(shape))
        todo = {name: [p for p in args.passes if (name, *astuple(shape)[:5], p) not in done] for name in args.backends}
        skips = {name: factories[name] if isinstance(factories[name], str)
                 else score_memory_skip_reason(name, shape, dtype.itemsize, free) for name in args.backends}
        run_now = {name: factories[name] for name in args.backends if todo[name] and not skips[name]}
        cells_by_backend = measure(run_now, shape, todo, dtype, device, args.rep_ms, args.rounds)
        for name in args.backends:
            cells = cells_by_backend.get(name) or {p: empty_cell(skips[name]) for p in todo[name]}
            # which of our kernels ran: the tuner's choice per kernel, a fact the times alone do not tell
            ran_ours = name == "triton" and name in cells_by_backend
            chosen = {kernel: str(choice) for kernel, choice in tuner.tuned_choices(
                shape.hs, shape.causal, dtype, shape.T, shape.T).items()} if ran_ours else {}
            rows += [{"backend": name, **asdict(shape), "pass": p, **cell, **({"tuner": chosen} if chosen else {})}
                     for p, cell in cells.items()]
            bar.update()
        write_json(results_path, results)  # after every shape: a run cut off keeps what it measured
    bar.close()
    write_report(out_dir)
    return out_dir


def comma_list(cast):
    return lambda text: [cast(item) for item in text.split(",") if item]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--backends", type=comma_list(str), help=f"comma-separated, from {','.join(BACKENDS)}")
    p.add_argument("--passes", type=comma_list(str), default=list(PASSES), help="comma-separated: fwd,bwd,fwd+bwd")
    p.add_argument("--grid", choices=list(GRIDS), help="shape preset: default full on cuda, toy on cpu")
    p.add_argument("--quick", action="store_const", const="quick", dest="grid", help="same as --grid quick")
    p.add_argument("--seq_lens", type=comma_list(int), help="override the grid's sequence lengths")
    p.add_argument("--head_dims", type=comma_list(int), help="override the grid's head dims")
    p.add_argument("--causal", type=comma_list(parse_bool), default=[True, False], help="true,false (default both)")
    p.add_argument("--tokens", type=int, help="B*T of every grid shape (default 16384)")
    p.add_argument("--width", type=int, help="nh*hs of every grid shape (default 2048)")
    p.add_argument("--batch", type=int, help="fix B instead of B*T (e.g. --batch 1 for memory vs T)")
    p.add_argument("--gpt2", action=argparse.BooleanOptionalAction, help="add the GPT-2 shape B=16 nh=12 T=1024 hs=64")
    p.add_argument("--rep_ms", type=float, default=100.0, help="time spent timing each cell (do_bench's rep)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per shape, every backend timed once in each, the order rotating; a cell's ms is "
                        "the median of its rounds")
    p.add_argument("--out_dir", help="default out/kernels/")
    p.add_argument("--resume", action="store_true", help="keep the cells already in out_dir/results.json")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    on_gpu = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    args.backends = args.backends or DEFAULT_BACKENDS["cuda" if on_gpu else "cpu"]
    for key, value in GRIDS[args.grid or ("full" if on_gpu else "toy")].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name in args.backends:
        if name not in BACKENDS:
            p.error(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    for pass_ in args.passes:
        if pass_ not in PASSES:
            p.error(f"unknown pass {pass_!r}; choose from {', '.join(PASSES)}")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give at least 1")
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    out_dir = run(args)
    print(f"results in {out_dir}")
    return out_dir


if __name__ == "__main__":
    main()
