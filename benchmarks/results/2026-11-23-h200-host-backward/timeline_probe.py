"""The GPT-2 cell's eager forward+backward as a host timeline, ours against cuDNN's: where the microseconds between
the call and the return of torch.autograd.grad go, with autograd's device thread (as the grid) and without, with
Python's cyclic GC on and off. Four rounds, backends alternating; medians of 300 calls per round.
    PYTHONPATH=. python3 benchmarks/results/2026-11-23-h200-host-backward/timeline_probe.py OUT_DIR"""
import gc, json, os, statistics, sys, time
import torch, triton
from benchmarks.attention import forced_sdpa_backend, registry_backend
from attention import triton_op

out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
B, H, T, D = 16, 12, 1024, 64
q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn_like(q)
fns = {"cudnn": forced_sdpa_backend("sdpa-cudnn"), "triton": registry_backend("triton")}

marks = {}
Fn = triton_op.FlashAttentionFunction
plain_forward, plain_backward = Fn.forward, Fn.backward


def marked_forward(ctx, *args):
    marks["fn fwd in"] = time.perf_counter()
    r = plain_forward(ctx, *args)
    marks["fn fwd out"] = time.perf_counter()
    return r


def marked_backward(ctx, *args):
    marks["fn bwd in"] = time.perf_counter()
    r = plain_backward(ctx, *args)
    marks["fn bwd out"] = time.perf_counter()
    return r


Fn.forward, Fn.backward = staticmethod(marked_forward), staticmethod(marked_backward)
SPANS = [("call -> fn fwd", "t0", "fn fwd in"), ("fn fwd", "fn fwd in", "fn fwd out"), ("fn fwd -> return", "fn fwd out", "t1"),
         ("return -> fn bwd", "t1", "fn bwd in"), ("fn bwd", "fn bwd in", "fn bwd out"), ("fn bwd -> grad returns", "fn bwd out", "t2"),
         ("free graph", "t2", "t3"), ("forward", "t0", "t1"), ("grad", "t1", "t2"), ("whole", "t0", "t3")]


def timeline(fn, calls=300):
    spans = {name: [] for name, _, _ in SPANS}
    for i in range(calls):
        if i % 50 == 0:
            torch.cuda.synchronize()
        marks.clear()
        marks["t0"] = time.perf_counter()
        o = fn(q, k, v, True)
        marks["t1"] = time.perf_counter()
        torch.autograd.grad(o, (q, k, v), dout)
        marks["t2"] = time.perf_counter()
        del o
        marks["t3"] = time.perf_counter()
        for name, a, b in SPANS:
            if a in marks and b in marks:
                spans[name].append(1e6 * (marks[b] - marks[a]))
    torch.cuda.synchronize()
    return {name: round(statistics.median(s), 1) for name, s in spans.items() if s}


results = []
for rnd in range(4):
    for threaded in (True, False):
        for gc_on in (True, False):
            for name, fn in (fns.items() if rnd % 2 == 0 else reversed(fns.items())):
                (gc.enable if gc_on else gc.disable)()
                with torch.autograd.set_multithreading_enabled(threaded):
                    timeline(fn, 20)
                    r = timeline(fn)
                gc.enable()
                results.append(dict(round=rnd, backend=name, threads=threaded, gc=gc_on, **r))
names = [n for n, _, _ in SPANS]
lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
         f"{time.strftime('%Y-%m-%d %H:%M')}; median us per call of each span", "",
         "| backend | threads | gc | " + " | ".join(names) + " |", "|---" * (len(names) + 3) + "|"]
for backend in fns:
    for threaded in (True, False):
        for gc_on in (True, False):
            rs = [r for r in results if (r["backend"], r["threads"], r["gc"]) == (backend, threaded, gc_on)]
            cells = [" / ".join(f"{r[n]:.0f}" for r in rs) if n in rs[0] else "" for n in names]
            lines.append(f"| {backend} | {threaded} | {gc_on} | " + " | ".join(cells) + " |")
text = "\n".join(lines)
print(text)
open(os.path.join(out_dir, "timeline_probe.txt"), "w").write(text + "\n")
json.dump(results, open(os.path.join(out_dir, "timeline_probe.json"), "w"), indent=1)
