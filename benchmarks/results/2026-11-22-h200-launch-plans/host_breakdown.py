"""Host time per eager call at GPT-2's cell, triton vs cuDNN, and a cProfile of ours (backward on the calling thread).
    PYTHONPATH=. python3 .gpu_carry/host_breakdown.py [out_dir]"""
import cProfile, io, pstats, statistics, sys, time, os
import torch, triton
from benchmarks.attention import forced_sdpa_backend, registry_backend

out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
q, k, v = (torch.randn(16, 12, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn_like(q)
fns = {"sdpa-cudnn": forced_sdpa_backend("sdpa-cudnn"), "triton": registry_backend("triton")}

def passes(fn):
    def fwd_nograd():
        with torch.no_grad():
            fn(q, k, v, True)
    out = fn(q, k, v, True)
    return {"fwd (no grad)": fwd_nograd, "fwd": lambda: fn(q, k, v, True),
            "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
            "fwd+bwd": lambda: torch.autograd.grad(fn(q, k, v, True), (q, k, v), dout)}

def host_us(step, calls=300):
    times = []
    for i in range(calls):
        if i % 50 == 0:
            torch.cuda.synchronize()  # never let the launch queue fill
        t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)

lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", "",
         "| pass | backend | host us/call (median of 300) | do_bench ms |", "|---|---|---|---|"]
for rnd in range(2):
    for name, fn in fns.items():
        for pname, step in passes(fn).items():
            step(); step(); torch.cuda.synchronize()
            ms = triton.testing.do_bench(step, return_mode="median")
            lines.append(f"| {pname} | {name} | {host_us(step):.1f} | {ms:.4f} |")
for threaded in (True, False):
    with torch.autograd.set_multithreading_enabled(threaded):
        step = passes(fns["triton"])["fwd+bwd"]
        lines.append(f"multithreading {threaded}: triton fwd+bwd host {host_us(step):.1f} us")
        step = passes(fns["sdpa-cudnn"])["fwd+bwd"]
        lines.append(f"multithreading {threaded}: cudnn fwd+bwd host {host_us(step):.1f} us")
print("\n".join(lines))
with torch.autograd.set_multithreading_enabled(False):
    step = passes(fns["triton"])["fwd+bwd"]
    prof = cProfile.Profile()
    prof.enable()
    for i in range(300):
        if i % 50 == 0: torch.cuda.synchronize()
        step()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(45)
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
open(os.path.join(out_dir, "host_breakdown.txt"), "w").write("\n".join(lines) + "\n\n" + s.getvalue())
