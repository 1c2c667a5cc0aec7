"""Host (CPU) time per eager attention call: ours beside cuDNN's and FlashAttention-2's (both through sdpa), in one
process, rounds rotating, medians, triton twice (an A/A pair: the run's own noise).

A kernel whose host-side launch path takes longer than its GPU work leaves the GPU idle between calls: at small
shapes (a tiny one, where GPU work is negligible, and GPT-2's B=16, nh=12, T=1024) that, not the kernel, sets the speed.

    python -m benchmarks.launch_overhead                   # the table: host us per call, and wall us per call
    python -m benchmarks.launch_overhead --out_dir DIR     # also DIR/results.json and DIR/results.md
    python -m benchmarks.launch_overhead --timeline        # where an eager forward+backward's host time goes
    python -m benchmarks.launch_overhead --profile         # cProfile's top functions of triton's forward+backward
"""
import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import attention
from benchmarks.attention import inputs_of
from benchmarks.report import rotations, write_results

def host_us(fn, calls=40) -> tuple[float, float]:
    """-> (host, wall) us per call over `calls` calls in a row: host until the last call returns, wall until the GPU
    has run them too (the slower of host and GPU, as a user's loop of eager calls sees it). Host time as long as the
    launch queue does not fill (a few launches per call). Short runs in many rounds (measure) give medians that move
    less with the machine's moods than long runs in few."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return 1e6 * host / calls, 1e6 * wall / calls


# The spans of one eager forward+backward, from the call to the return of torch.autograd.grad; for the triton backend
# also where its autograd Function's forward and backward begin and end. With multithreading on (PyTorch's default),
# autograd runs the backward of CUDA tensors on a thread of its own per device, so the Function's backward runs there
# and "-> Function.backward" and "-> grad returns" include the hand-overs between the two threads.
SPANS = (("call -> Function.forward", "call", "fwd in"), ("Function.forward", "fwd in", "fwd out"),
         ("-> forward returns", "fwd out", "fwd returned"), ("-> Function.backward", "fwd returned", "bwd in"),
         ("Function.backward", "bwd in", "bwd out"), ("-> grad returns", "bwd out", "grad returned"),
         ("forward", "call", "fwd returned"), ("grad", "fwd returned", "grad returned"),
         ("whole", "call", "grad returned"))


@contextlib.contextmanager
def marked_function(marks: dict):
    """FlashAttentionFunction with perf_counter marks (SPANS' names) at its forward's and backward's entry and exit."""
    from attention.flash.autograd import FlashAttentionFunction  # only here: the table runs on older checkouts too

    plain_forward, plain_backward = FlashAttentionFunction.forward, FlashAttentionFunction.backward

    def marked(method, enter, leave):
        def run(ctx, *args):
            marks[enter] = time.perf_counter()
            result = method(ctx, *args)
            marks[leave] = time.perf_counter()
            return result
        return staticmethod(run)
    FlashAttentionFunction.forward = marked(plain_forward, "fwd in", "fwd out")
    FlashAttentionFunction.backward = marked(plain_backward, "bwd in", "bwd out")
    try:
        yield
    finally:
        FlashAttentionFunction.forward = staticmethod(plain_forward)
        FlashAttentionFunction.backward = staticmethod(plain_backward)


def timeline(backend: str, q, k, v, do, calls: int = 300, sync=torch.cuda.synchronize) -> dict[str, float]:
    """Median host microseconds of each of SPANS over `calls` eager forward+backward calls of attention(backend) on
    q, k, v (leaves that require grad); sync (every 50 calls) keeps the launch queue from filling."""
    marks, spans = {}, {name: [] for name, _, _ in SPANS}
    with marked_function(marks):
        for i in range(calls):
            if i % 50 == 0:
                sync()
            marks.clear()
            marks["call"] = time.perf_counter()
            out = attention(q, k, v, causal=True, backend=backend)
            marks["fwd returned"] = time.perf_counter()
            torch.autograd.grad(out, (q, k, v), do)
            marks["grad returned"] = time.perf_counter()
            del out  # its graph is freed here, outside the spans
            for name, start, end in SPANS:
                if start in marks and end in marks:
                    spans[name].append(1e6 * (marks[end] - marks[start]))
    sync()
    return {name: statistics.median(times) for name, times in spans.items() if times}


def print_timelines(q, k, v, do, rounds: int = 2) -> None:
    """timeline() of triton and sdpa (whichever kernel PyTorch picks), autograd's device thread on and off, in `rounds`
    rounds: host time changes from round to round, so only figures of one round compare."""
    print("| backend | autograd thread | round | " + " | ".join(name for name, _, _ in SPANS) + " |")
    print("|---" * (len(SPANS) + 3) + "|")
    for round_ in range(rounds):
        for threaded in (True, False):
            for backend in ("triton", "sdpa"):
                with torch.autograd.set_multithreading_enabled(threaded):
                    timeline(backend, q, k, v, do, calls=20)  # warm
                    spans = timeline(backend, q, k, v, do)
                cells = [f"{spans[name]:.0f}" if name in spans else "" for name, _, _ in SPANS]
                print(f"| {backend} | {'device' if threaded else 'calling'} | {round_} | " + " | ".join(cells) + " |")


SHAPES = {"tiny": (1, 1, 128, 64), "gpt2": (16, 12, 1024, 64)}  # B, nh, T, hs: bf16, causal


def _python_path():
    """triton's calls on the Python launch path (native.py's launcher off), where the checkout has one."""
    try:
        from attention.flash.native import python_path
    except ImportError:  # a checkout from before the native launcher: every call takes the Python path
        return contextlib.nullcontext()
    return python_path()


def _native_built() -> None:
    """Wait for the native launcher's build (it builds in the background on a process's first eager call), so that
    every timed call of triton's has it where the checkout has one."""
    try:
        from attention.flash.native import wait
    except ImportError:
        return
    wait()


# backend label -> (attention backend, the context it runs in: the sdpa kernel it is held to, the launch path)
BACKENDS = {"triton": ("triton", contextlib.nullcontext), "triton-again": ("triton", contextlib.nullcontext),
            "triton-python": ("triton", _python_path),
            "cudnn": ("sdpa", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)),
            "fa2": ("sdpa", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION))}


def make_call(backend: str, context, q, k, v, do, grad: bool):
    """One eager call as a user makes it: attention() alone, or attention() then torch.autograd.grad."""

    def call():
        with context():
            if not grad:
                with torch.no_grad():
                    attention(q, k, v, causal=True, backend=backend)
            else:
                torch.autograd.grad(attention(q, k, v, causal=True, backend=backend), (q, k, v), do)
    return call


def measure(shapes: dict, rounds: int) -> list[dict]:
    """-> a row per (shape, pass, backend): median host and wall us per call (host_us) over rounds, the backends in
    rotating order."""
    rows = []
    _native_built()
    for shape_name, (B, nh, T, hs) in shapes.items():
        q, k, v, do = inputs_of(B, nh, T, hs, torch.bfloat16, "cuda", "model")  # views of one (B, T, 3, nh, hs)
        for grad in (False, True):
            calls = {name: make_call(backend, context, q, k, v, do, grad)
                     for name, (backend, context) in BACKENDS.items()}
            times = {name: [] for name in calls}
            for names in rotations(list(calls), rounds):
                for name in names:
                    times[name].append(host_us(calls[name]))
            for name, call in calls.items():
                rows.append(dict(shape=shape_name, B=B, nh=nh, T=T, hs=hs, pass_="fwd+bwd" if grad else "fwd",
                                 backend=name, host_us=statistics.median(t[0] for t in times[name]),
                                 wall_us=statistics.median(t[1] for t in times[name])))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| shape | pass | " + " | ".join(BACKENDS) + " | triton / cuDNN (host) | cuDNN / triton (wall) |",
             "|---" * (len(BACKENDS) + 4) + "|"]
    for (shape, pass_) in dict.fromkeys((r["shape"], r["pass_"]) for r in rows):
        cells = {r["backend"]: r for r in rows if (r["shape"], r["pass_"]) == (shape, pass_)}
        host = " | ".join(f"{cells[name]['host_us']:.0f} ({cells[name]['wall_us']:.0f})" for name in BACKENDS)
        lines.append(f"| {shape} | {pass_} | {host} | {cells['triton']['host_us'] / cells['cudnn']['host_us']:.2f} | "
                     f"{cells['cudnn']['wall_us'] / cells['triton']['wall_us']:.2f}x |")
    return "\n".join(lines)


def profile(q, k, v, do) -> None:
    """cProfile's top functions of triton's eager forward+backward, the backward on the calling thread (cProfile sees
    one thread)."""
    call = make_call("triton", contextlib.nullcontext, q, k, v, do, grad=True)
    with torch.autograd.set_multithreading_enabled(False):
        call()
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [call() for _ in range(200)])
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out_dir", default=None, help="write results.json and results.md here")
    p.add_argument("--profile", action="store_true", help="cProfile's top functions of triton at the tiny shape")
    p.add_argument("--timeline", action="store_true",
                   help="only the span-by-span host timeline of an eager forward+backward at GPT-2's shape")
    args = p.parse_args(argv)
    if args.timeline or args.profile:
        B, nh, T, hs = SHAPES["gpt2" if args.timeline else "tiny"]
        q, k, v = (torch.randn(B, nh, T, hs, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        if args.timeline:
            print(f"B={B} nh={nh} T={T} hs={hs} bf16 causal, {torch.cuda.get_device_name()}: median host us per span")
            print_timelines(q, k, v, do)
        else:
            profile(q, k, v, do)
        return
    rows = measure(SHAPES, args.rounds)
    text = (f"{torch.cuda.get_device_name()}, bf16 causal, eager; host us per call (wall us per call), medians of "
            f"{args.rounds} rotating rounds; triton-again: the A/A pair; triton-python: the Python launch path\n\n{table(rows)}")
    print(text)
    if args.out_dir:
        write_results(args.out_dir, rows, text)


if __name__ == "__main__":
    main()
