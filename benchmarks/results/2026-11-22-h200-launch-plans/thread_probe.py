"""Is Python run by autograd's worker thread slower than on the calling thread? GPT-2 cell, cuDNN sdpa, plus a
Python autograd.Function whose backward does a fixed amount of Python work."""
import statistics, time, sys, os
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

q, k, v = (torch.randn(16, 12, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn_like(q)
table = {i: i for i in range(64)}

def busy(n):
    s = 0
    for i in range(n):
        s += table[i & 63]
    return s

class PyNode(torch.autograd.Function):
    work = 0
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)
    @staticmethod
    def backward(ctx, g):
        busy(PyNode.work)
        return g

def sdpa(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

def host_us(step, calls=300):
    times = []
    for i in range(calls):
        if i % 50 == 0:
            torch.cuda.synchronize()
        t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)

def busy_us(n):
    t = time.perf_counter()
    for _ in range(100):
        busy(n)
    return 1e6 * (time.perf_counter() - t) / 100

steps = {"cudnn": lambda: torch.autograd.grad(sdpa(q, k, v), (q, k, v), dout),
         "cudnn + python node": lambda: torch.autograd.grad(PyNode.apply(sdpa(q, k, v)), (q, k, v), dout)}
lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, python {sys.version.split()[0]}, cpus {os.cpu_count()}"]
for rnd in range(3):
    for work in (0, 1000, 4000):
        PyNode.work = work
        lines.append(f"round {rnd} python work {work} iterations = {busy_us(work):.1f} us on the calling thread")
        for threaded in (True, False):
            with torch.autograd.set_multithreading_enabled(threaded):
                for name, step in steps.items():
                    if work and name == "cudnn":
                        continue
                    step(); step()
                    lines.append(f"  {name:22s} threaded={threaded!s:5s} host {host_us(step):7.1f} us")
print("\n".join(lines))
