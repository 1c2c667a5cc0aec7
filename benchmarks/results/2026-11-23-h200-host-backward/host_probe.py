"""Where the GPT-2 cell's eager host time goes (B=16, nh=12, T=1024, hs=64, causal, bf16), ours against cuDNN's.
    PYTHONPATH=. python3 benchmarks/results/2026-11-23-h200-host-backward/host_probe.py OUT_DIR
Host time: median perf_counter microseconds per call over 300 calls, synchronizing every 50 so the launch queue never
fills. Writes OUT_DIR/host_probe.txt (tables, then cProfile of our forward+backward with the backward on the calling
thread)."""
import cProfile, io, os, pstats, statistics, sys, time
import torch, triton
from benchmarks.attention import forced_sdpa_backend, registry_backend
from attention import triton_flash, triton_hopper, triton_hopper_backward, triton_op

out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
B, H, T, D = 16, 12, 1024, 64
q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn_like(q)
fns = {"cudnn": forced_sdpa_backend("sdpa-cudnn"), "triton": registry_backend("triton")}
lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
         f"{time.strftime('%Y-%m-%d %H:%M')}", ""]


def host_us(step, calls=300):
    times = []
    for i in range(calls):
        if i % 50 == 0:
            torch.cuda.synchronize()
        t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def row(name, step, gpu=True):
    step(); step(); torch.cuda.synchronize()
    ms = triton.testing.do_bench(step, return_mode="median", grad_to_none=[q, k, v]) if gpu else float("nan")
    lines.append(f"| {name} | {host_us(step):.1f} | {ms:.4f} |")


def passes(fn):
    out = fn(q, k, v, True)
    return {"fwd": lambda: fn(q, k, v, True),
            "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
            "fwd+bwd": lambda: torch.autograd.grad(fn(q, k, v, True), (q, k, v), dout)}


# 1. the cells, with autograd's device thread (as the grid) and without
lines += ["| pass | host us | do_bench ms |", "|---|---|---|"]
for threaded in (True, False):
    with torch.autograd.set_multithreading_enabled(threaded):
        for rnd in range(2):
            for name, fn in fns.items():
                for pname, step in passes(fn).items():
                    row(f"{name} {pname} threads={threaded} round {rnd}", step)

# 2. the floor of a Python autograd node: a Function whose backward returns ready gradients
grads = [torch.empty_like(q) for _ in range(3)]


class Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, do):
        ctx.saved_tensors
        return tuple(grads)


lines += ["", "| floor | host us | do_bench ms |", "|---|---|---|"]
for threaded in (True, False):
    with torch.autograd.set_multithreading_enabled(threaded):
        row(f"python Function, no work, fwd+bwd threads={threaded}",
            lambda: torch.autograd.grad(Noop.apply(q, k, v), (q, k, v), dout), gpu=False)
        row(f"torch.empty_like x3 + python Function fwd+bwd threads={threaded}",
            lambda: [torch.empty_like(q) for _ in range(3)] and
            torch.autograd.grad(Noop.apply(q, k, v), (q, k, v), dout), gpu=False)

# 3. the timeline of one threaded forward+backward: when our backward starts and ends on autograd's thread
marks = {}
plain_backward = triton_op.FlashAttentionFunction.backward


def marked_backward(ctx, do, dlse):
    marks["bwd in"] = time.perf_counter()
    r = plain_backward(ctx, do, dlse)
    marks["bwd out"] = time.perf_counter()
    return r


triton_op.FlashAttentionFunction.backward = staticmethod(marked_backward)
spans = {key: [] for key in ("forward", "to our backward", "our backward", "back to caller", "whole")}
for i in range(300):
    if i % 50 == 0:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    o = fns["triton"](q, k, v, True)
    t1 = time.perf_counter()
    torch.autograd.grad(o, (q, k, v), dout)
    t2 = time.perf_counter()
    for key, span in zip(spans, (t1 - t0, marks["bwd in"] - t1, marks["bwd out"] - marks["bwd in"],
                                 t2 - marks["bwd out"], t2 - t0)):
        spans[key].append(1e6 * span)
triton_op.FlashAttentionFunction.backward = staticmethod(plain_backward)
torch.cuda.synchronize()
lines += ["", "timeline of our threaded fwd+bwd, median us: " +
          ", ".join(f"{key} {statistics.median(s):.1f}" for key, s in spans.items())]

# 4. our backward's parts on the calling thread
qd, kd, vd = (t.detach() for t in (q, k, v))
scale = D ** -0.5
o, lse = triton_flash.forward(qd, kd, vd, True, scale)
dq, dk, dv = triton_flash.backward(dout, qd, kd, vd, o, lse, True, scale)
bwd_key = triton_flash._plan_key("bwd", True, triton_flash.DENSE, dout, qd, kd, vd, o, lse, dq, dk, dv)
again = triton_flash._plans[bwd_key]
lines += ["", "| part (calling thread) | host us | do_bench ms |", "|---|---|---|"]
row("triton_flash.forward", lambda: triton_flash.forward(qd, kd, vd, True, scale))
row("triton_flash.backward", lambda: triton_flash.backward(dout, qd, kd, vd, o, lse, True, scale))
row("plan key (9 tensors)", lambda: triton_flash._plan_key("bwd", True, triton_flash.DENSE, dout, qd, kd, vd, o, lse,
                                                          dq, dk, dv), gpu=False)
row("3 empty_bthd", lambda: [triton_flash.empty_bthd(B, H, T, D, qd) for _ in range(3)], gpu=False)
row("plan again (no grads allocated)", lambda: again(dout, qd, kd, vd, o, lse, dq, dk, dv, scale))

# 5. each launch of the Hopper backward's plan, recorded as it is made, then repeated alone
recorded = []
plain_launch = triton_hopper_backward.launch


def recording_launch(fn, grid, args, **constants):
    launched = plain_launch(fn, grid, args, **constants)
    recorded.append((fn.__name__ if hasattr(fn, "__name__") else str(fn), grid, args, launched))
    return launched


triton_hopper_backward.launch = recording_launch
tile = triton_flash._best_backward and next(iter(triton_flash._best_backward.values()))
lines.append(f"tuned backward tile: {tile}")
if tile is not None:
    triton_hopper_backward.backward(dout, qd, kd, vd, o, lse, dq, dk, dv, True, scale, tile)
triton_hopper_backward.launch = plain_launch
from triton.backends.nvidia.driver import make_tensordesc_arg
for name, grid, args, launched in recorded:
    row(f"launch again: {getattr(launched.compiled, 'name', name)} ({len(args)} args)",
        lambda: launched.again(*args))
    metas = getattr(launched.compiled.metadata, "tensordesc_meta", None) or []
    descs = [a for a in args if type(a).__name__ == "TensorDescriptor"]
    if descs:
        row(f"  make_tensordesc_arg x{len(descs)}",
            lambda: [make_tensordesc_arg(d, m) for d, m in zip(descs, metas or [None] * len(descs))], gpu=False)
    row("  torch.cuda.current_stream + current_device", lambda: (torch.cuda.current_device(),
                                                                  torch.cuda.current_stream().cuda_stream), gpu=False)

# 6. cProfile of our forward+backward, backward on the calling thread
with torch.autograd.set_multithreading_enabled(False):
    step = passes(fns["triton"])["fwd+bwd"]
    prof = cProfile.Profile()
    prof.enable()
    for i in range(300):
        if i % 50 == 0:
            torch.cuda.synchronize()
        step()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
text = "\n".join(lines)
print(text)
open(os.path.join(out_dir, "host_probe.txt"), "w").write(text + "\n\n" + s.getvalue())
