"""Host time and do_bench time per eager call, the package on sys.path (before or after the launch plans), against
cuDNN in the same process. One JSON line per (cell, pass, backend).
    PYTHONPATH=<package root> python3 plans_probe.py LABEL OUT.jsonl"""
import json, statistics, sys, time
import torch, triton
from torch.nn.attention import SDPBackend, sdpa_kernel
import attention as package
from attention import attention

label, out_path = sys.argv[1], sys.argv[2]
CELLS = [(16, 12, 1024, 64, True), (16, 16, 1024, 128, True), (16, 32, 1024, 64, False), (4, 16, 4096, 128, False)]

def cudnn(q, k, v, causal):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return attention(q, k, v, causal=causal, backend="sdpa")

def triton_backend(q, k, v, causal):
    return attention(q, k, v, causal=causal, backend="triton")

def host_us(step, calls=200):
    times = []
    for i in range(calls):
        if i % 25 == 0:
            torch.cuda.synchronize()  # the launch queue never fills
        t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)

with open(out_path, "a") as f:
    for B, H, T, D, causal in CELLS:
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        for name, fn in (("sdpa-cudnn", cudnn), ("triton", triton_backend)):
            out = fn(q, k, v, causal)
            steps = {"fwd": lambda: fn(q, k, v, causal),
                     "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                     "fwd+bwd": lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), dout)}
            for pass_, step in steps.items():
                step(); step(); torch.cuda.synchronize()
                ms = triton.testing.do_bench(step, rep=100, return_mode="median")
                row = dict(label=label, package=package.__file__, B=B, H=H, T=T, D=D, causal=causal, pass_=pass_,
                           backend=name, host_us=round(host_us(step), 1), ms=round(ms, 4),
                           gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
                f.write(json.dumps(row) + "\n")
                print(label, B, H, T, D, causal, pass_, name, row["host_us"], row["ms"], flush=True)
