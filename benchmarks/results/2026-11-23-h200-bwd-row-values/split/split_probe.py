"""Probe: why our forward+backward takes longer than our forward plus our backward timed apart (hs=128 non-causal 4k:
+2-3% in every grid), where cuDNN's adds up. For each shape and backend: the three passes timed as the grid times
them (benchmarks.attention.measure: do_bench, three rotating rounds), then each pass traced by torch.profiler over
30 calls with the L2 flush between them as do_bench does: per kernel its median time, per call the span from the
first kernel after the flush to the last kernel's end and the idle time between kernels. If the kernels of
forward+backward take as long as they do apart and the span is longer, the cost is gaps (host, launch); if a kernel
itself is slower after the forward, it is the GPU's state (clock under the power cap, L2).

    PYTHONPATH=$PWD python3 benchmarks/results/2026-11-23-h200-bwd-row-values/split/split_probe.py OUT_DIR
"""
import datetime
import json
import statistics
import sys

import torch
import triton
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.attention import PASSES, Shape, forced_sdpa_backend, measure, pass_step, registry_backend

SHAPES = [Shape(4, 16, 4096, 128, False, "grid"), Shape(16, 32, 1024, 64, False, "grid"),
          Shape(4, 32, 4096, 64, True, "grid"), Shape(1, 16, 16384, 128, True, "grid")]
BACKENDS = {"sdpa-cudnn": forced_sdpa_backend("sdpa-cudnn"), "triton": registry_backend("triton")}
CALLS = 30
out_dir = sys.argv[1]
flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # do_bench's L2 flush buffer


def trace(step) -> dict:
    """Kernel times of CALLS calls, each after the L2 flush: {kernel: median us}, span and gaps per call (us)."""
    for _ in range(3):
        flush.zero_()
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            flush.zero_()
            step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    calls, current = [], None
    for e in kernels:
        if "FillFunctor<signed char>" in e.name:  # the flush: a new call starts after it
            current = []
            calls.append(current)
        elif current is not None:
            current.append((e.name, e.time_range.start, e.time_range.end))
    per_kernel, spans, gaps = {}, [], []
    for call in calls:
        if not call:
            continue
        for name, start, end in call:
            per_kernel.setdefault(name[:90], []).append(end - start)
        spans.append(call[-1][2] - call[0][1])
        gaps.append(sum(max(0.0, b[1] - a[2]) for a, b in zip(call, call[1:])))
    return dict(calls=len(spans), span_us=statistics.median(spans), gaps_us=statistics.median(gaps),
                kernels={name: statistics.median(ts) for name, ts in per_kernel.items()})


rows = []
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
for shape in SHAPES:
    cells = measure(BACKENDS, shape, {name: list(PASSES) for name in BACKENDS}, torch.bfloat16,
                    torch.device("cuda"), 100.0, rounds=3)
    for name, fn in BACKENDS.items():
        q, k, v = (torch.randn(shape.B, shape.nh, shape.T, shape.hs, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        for pass_ in PASSES:
            traced = trace(pass_step(fn, pass_, q, k, v, dout, shape.causal))
            rows.append(dict(shape=str(shape), backend=name, pass_=pass_, do_bench_ms=cells[name][pass_]["ms"],
                             **traced))
            print(json.dumps(rows[-1]), flush=True)

with open(f"{out_dir}/split.json", "w") as f:
    json.dump(dict(meta=meta, rows=rows), f, indent=1)

# the table: per shape and backend, do_bench's fwd+bwd against fwd + bwd, and the traced spans and kernel sums
print(f"\n{meta}\n")
print("| shape | backend | do_bench fwd+bwd / (fwd + bwd) | traced span fwd+bwd / (fwd + bwd) | kernel sum fwd+bwd / "
      "(fwd + bwd) | gaps fwd+bwd, fwd, bwd (us) |")
print("|---|---|---|---|---|---|")
for shape in SHAPES:
    for name in BACKENDS:
        by = {r["pass_"]: r for r in rows if r["shape"] == str(shape) and r["backend"] == name}
        f, b, fb = by["fwd"], by["bwd"], by["fwd+bwd"]
        ksum = {p: sum(r["kernels"].values()) for p, r in by.items()}
        print(f"| {shape} | {name} | {fb['do_bench_ms'] / (f['do_bench_ms'] + b['do_bench_ms']):.3f} | "
              f"{fb['span_us'] / (f['span_us'] + b['span_us']):.3f} | "
              f"{ksum['fwd+bwd'] / (ksum['fwd'] + ksum['bwd']):.3f} | "
              f"{fb['gaps_us']:.1f}, {f['gaps_us']:.1f}, {b['gaps_us']:.1f} |")
print("\nper kernel, fwd+bwd against its own pass (us):")
for shape in SHAPES:
    for name in BACKENDS:
        by = {r["pass_"]: r for r in rows if r["shape"] == str(shape) and r["backend"] == name}
        for kernel, t in by["fwd+bwd"]["kernels"].items():
            alone = by["fwd"]["kernels"].get(kernel, by["bwd"]["kernels"].get(kernel))
            print(f"  {shape} {name} {kernel[:60]}: {t:.1f} vs {alone if alone is None else round(alone, 1)}")
