"""Where the time of one sparse-attention call goes: the GPU kernels of a forward+backward under
torch.profiler, summed per kernel, for our backend and FlexAttention side by side.

    python -m benchmarks.profile_kernels --family moba --T 32768 --hs 128
    python -m benchmarks.profile_kernels --family window --T 16384 --flex

The shapes, masks and call paths are benchmarks/sparse.py's (B*T = 16384 tokens, nh*hs = 2048), so
a cell of that benchmark can be taken apart here. For finding what to optimise; not a benchmark.
"""
import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from benchmarks.attention import Shape, pass_step
from benchmarks.launch_overhead import host_us
from benchmarks.sparse import FAMILIES, GRIDS, MASKS, flex, ours, packed_document_ids


def back_to_back_us(step, calls: int = 50) -> float:
    """GPU time per call of calls issued back to back: no cache flush between them, the host ahead."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    step()
    start.record()
    for _ in range(calls):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def kernel_timeline(step, calls: int = 30) -> str:
    """Where a call's wall time goes beyond its kernels: `calls` calls issued back to back under the
    profiler, read by timeline_table."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())["traceEvents"]
    return timeline_table(trace, calls)


def timeline_table(trace: list[dict], calls: int) -> str:
    """From a chrome trace's events: per kernel of a call (in launch order), its median duration in the
    first and the last third of the run (a clock that drops under sustained load makes the last third
    slower), the GPU's idle time before it (the gap after the previous kernel ended), and the host's
    lead: how long before the kernel started its launch call had returned (near 0 with an idle gap:
    the GPU waited for the host to launch it)."""
    launches = {e["args"]["correlation"]: e["ts"] + e["dur"] for e in trace
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    per_call = len(kernels) // calls
    rows = {}  # position in the call -> (name, durations, idle before, host lead)
    for i, e in enumerate(kernels[:per_call * calls]):
        name, durations, idles, leads = rows.setdefault(i % per_call, (e["name"][:60], [], [], []))
        durations.append(e["dur"])
        if i:
            previous = kernels[i - 1]
            idles.append(e["ts"] - previous["ts"] - previous["dur"])
        launched = launches.get(e["args"].get("correlation"))
        if launched is not None:
            leads.append(e["ts"] - launched)
    third = max(1, calls // 3)
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / calls
    busy = sum(e["dur"] for e in kernels) / calls
    lines = [f"trace of {calls} calls back to back: {span:.0f} us per call from first kernel start to last kernel end, "
             f"{busy:.0f} us of it in kernels",
             f"{'first':>7} {'last':>7} {'idle':>6} {'lead':>7}  kernel (us, medians; first/last: third of the run)"]
    median = lambda xs: statistics.median(xs) if xs else float("nan")
    for name, durations, idles, leads in rows.values():
        lines.append(f"{median(durations[:third]):7.0f} {median(durations[-third:]):7.0f} {median(idles):6.1f} "
                     f"{median(leads):7.0f}  {name}")
    return "\n".join(lines)


def kernel_table(fn, shape: Shape, steps: int = 5, host: bool = False, timeline: bool = False) -> str:
    q, k, v = (torch.randn(shape.B, shape.nh, shape.T, shape.hs, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    step = pass_step(fn, "fwd+bwd", q, k, v, dout, True)
    for _ in range(3):  # compile, tune, warm the allocator
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if host else [])]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) / steps
    # the benchmark's timer spans kernels and the gaps between them: where it exceeds the kernels'
    # total, the GPU waited, and a host time per call near the timer's says for what
    timed = triton.testing.do_bench(step, return_mode="median") * 1e3
    lines = [f"do_bench {timed:.0f} us per fwd+bwd (L2 flushed before each call), {back_to_back_us(step):.0f} us back "
             f"to back; host {host_us(step):.0f} us per call (launch_overhead.host_us)",
             f"{'us/call':>9} {'calls':>5}  kernel   (GPU total {total:.0f} us per fwd+bwd)"]
    for e in events[:14]:
        lines.append(f"{e.self_device_time_total / steps:9.0f} {e.count // steps:5d}  {e.key[:100]}")
    if host:  # what the CPU spends its time on: launches, allocations, synchronisations
        calls = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        lines.append(f"{'host us':>9} {'calls':>5}  operation")
        lines += [f"{e.self_cpu_time_total / steps:9.0f} {e.count // steps:5d}  {e.key[:100]}" for e in calls[:12]]
    if timeline:
        lines.append(kernel_timeline(step))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=FAMILIES, default="moba")
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--hs", type=int, default=128)
    p.add_argument("--flex", action="store_true", help="profile FlexAttention with the same mask too")
    p.add_argument("--host", action="store_true", help="also list the host-side operations by CPU time")
    p.add_argument("--timeline", action="store_true",
                   help="also trace calls back to back: per kernel its duration early and late, the GPU idle before "
                        "it and the host's lead")
    args = p.parse_args(argv)
    for key, value in (GRIDS["full"] | MASKS["gpu"]).items():
        setattr(args, key, value)
    args.backend = "triton"
    shape = Shape(max(1, args.tokens // args.T), args.width // args.hs, args.T, args.hs, causal=True, group="grid")
    ids = packed_document_ids(shape.B, shape.T, args.doc_lengths, 0, "cuda") if args.family == "documents" else None
    table = kernel_table(ours(args.family, args, ids), shape, host=args.host, timeline=args.timeline)
    print(f"{args.family} {shape}\n-- ours (triton)\n{table}")
    if args.flex:
        flex_fn = flex(args.family, args, ids, shape, torch.device("cuda"))
        print(f"-- flex\n{kernel_table(flex_fn, shape, timeline=args.timeline)}")


if __name__ == "__main__":
    main()
