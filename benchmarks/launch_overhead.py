"""Host (CPU) time per attention call, layer by layer, next to the GPU time of the same call.

A kernel whose host-side launch path takes longer than its GPU work leaves the GPU idle between
calls: at small shapes (GPT-2's B=16, nh=12, T=1024) that, not the kernel, sets the speed.

    python -m benchmarks.launch_overhead            # GPT-2 shape, bf16
    python -m benchmarks.launch_overhead --timeline # where an eager forward+backward's host time goes, span by span
"""
import argparse
import contextlib
import cProfile
import functools
import pstats
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import triton

from attention import attention, attention_qkvpacked
from attention.flash import dispatch
from attention.flash import tuner
from attention.flash.autograd import FlashAttentionFunction, flash_attn_fwd


def host_us(fn, calls=200) -> float:
    """Mean host time per call with the GPU kept busy, so no call waits for the device."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * host / calls


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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="16,12,1024,64", help="B,nh,T,hs")
    p.add_argument("--profile", action="store_true",
                   help="also print torch.profiler's table and cProfile's top Python functions of triton fwd+bwd")
    p.add_argument("--timeline", action="store_true",
                   help="only the span-by-span host timeline of an eager forward+backward, triton and sdpa")
    args = p.parse_args()
    B, nh, T, hs = map(int, args.shape.split(","))
    q, k, v = (torch.randn(B, T, 3, nh, hs, device="cuda", dtype=torch.bfloat16).unbind(2))
    q, k, v = (t.transpose(1, 2).requires_grad_() for t in (q, k, v))  # (B, nh, T, hs) views, as in the model
    scale = hs ** -0.5
    o, lse = dispatch.forward(q.detach(), k.detach(), v.detach(), True, scale)
    do = torch.randn_like(o)
    if args.timeline:
        print(f"B={B} nh={nh} T={T} hs={hs} bf16 causal, {torch.cuda.get_device_name()}: median host us per span")
        print_timelines(q, k, v, do)
        return

    def fwd_bwd(backend):
        def run():
            attention(q, k, v, causal=True, backend=backend).backward(do)
        return run

    with torch.no_grad():
        cases = {
            "dispatch.forward (launch only)": lambda: dispatch.forward(q, k, v, True, scale),
            "operator nanoflash::flash_attn_fwd": lambda: flash_attn_fwd(q, k, v, True, scale),
            "attention(backend=triton), no grad": lambda: attention(q, k, v, backend="triton"),
            "attention(backend=sdpa), no grad": lambda: attention(q, k, v, backend="sdpa"),
        }
        rows = [(name, host_us(fn), triton.testing.do_bench(fn, return_mode="median") * 1e3) for name, fn in cases.items()]
    rows.append(("dispatch.backward (launch only)", host_us(lambda: dispatch.backward(do, q, k, v, o, lse, True, scale)),
                 triton.testing.do_bench(lambda: dispatch.backward(do, q, k, v, o, lse, True, scale), return_mode="median") * 1e3))
    for backend in ("triton", "sdpa"):
        fn = fwd_bwd(backend)
        rows.append((f"fwd+bwd autograd, {backend}", host_us(fn), triton.testing.do_bench(fn, grad_to_none=[q, k, v], return_mode="median") * 1e3))
    # the backward alone as benchmarks/attention.py times it: autograd.grad of one kept forward, on autograd's
    # worker thread (as in training) and on the calling thread
    for backend in ("triton", "sdpa"):
        out = attention(q, k, v, causal=True, backend=backend)
        fn = functools.partial(torch.autograd.grad, out, (q, k, v), do, retain_graph=True)
        for threaded in (True, False):
            with torch.autograd.set_multithreading_enabled(threaded):
                rows.append((f"bwd autograd.grad, {backend}, {'worker' if threaded else 'calling'} thread",
                             host_us(fn), triton.testing.do_bench(fn, return_mode="median") * 1e3))
    # as a compiled model calls it: torch.compile'd, on the (B, T, 3, nh, hs) view of a fused projection
    qkv = torch.randn(B, T, 3, nh, hs, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled_fwd_bwd = {}
    for backend in ("triton", "sdpa"):
        compiled = torch.compile(functools.partial(attention_qkvpacked, backend=backend), fullgraph=True)
        fn = compiled_fwd_bwd[backend] = functools.partial(lambda compiled: compiled(qkv).backward(do), compiled)
        rows.append((f"fwd+bwd compiled, packed qkv, {backend}", host_us(fn),
                     triton.testing.do_bench(fn, grad_to_none=[qkv], return_mode="median") * 1e3))

    if args.profile:
        for name, fn in (("eager", fwd_bwd("triton")), ("compiled", compiled_fwd_bwd["triton"])):
            # cProfile sees one thread: run the backward on this one (autograd uses a worker thread per GPU)
            with torch.autograd.set_multithreading_enabled(False):
                print(f"triton fwd+bwd {name}, autograd on the calling thread: {host_us(fn):.0f} host us/call")
                profiler = cProfile.Profile()
                profiler.runcall(lambda: [fn() for _ in range(100)])
            pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
        out = attention(q, k, v, causal=True, backend="triton")
        with torch.autograd.set_multithreading_enabled(False):
            profiler = cProfile.Profile()
            profiler.runcall(lambda: [torch.autograd.grad(out, (q, k, v), do, retain_graph=True) for _ in range(100)])
        print("triton bwd autograd.grad, calling thread")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
        fn = fwd_bwd("triton")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))

    print("tuner's choices:", tuner.best_tile, tuner.best_backward)
    print(f"\nB={B} nh={nh} T={T} hs={hs} bf16 causal, {torch.cuda.get_device_name()}")
    print("| call | host us/call | do_bench us |\n|---|---|---|")
    for name, host, gpu in rows:
        print(f"| {name} | {host:.0f} | {gpu:.0f} |")


if __name__ == "__main__":
    main()
