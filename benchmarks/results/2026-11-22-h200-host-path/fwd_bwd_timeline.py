"""Where the host time of one eager forward+backward goes, as benchmarks/attention.py times the GPT-2 cell:
torch.autograd.grad(attention(q, k, v), (q, k, v), dout), B=16 nh=12 T=1024 hs=64 causal bf16.

    PYTHONPATH=. python3 benchmarks/results/2026-11-22-h200-host-path/fwd_bwd_timeline.py

Wraps triton_flash.forward and .backward with clocks and prints the mean host microseconds between the marks,
on autograd's worker thread (as in training) and on the calling thread, then do_bench's time of the same call.
"""
import time

import torch
import triton

from attention import attention, triton_flash


def main():
    marks = {}
    forward, backward = triton_flash.forward, triton_flash.backward

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            marks[f"{name} in"] = time.perf_counter()
            result = fn(*args, **kwargs)
            marks[f"{name} out"] = time.perf_counter()
            return result
        return wrapper

    triton_flash.forward, triton_flash.backward = timed("forward", forward), timed("backward", backward)
    q, k, v = (torch.randn(16, 12, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def step():
        marks["start"] = time.perf_counter()
        out = attention(q, k, v, causal=True, backend="triton")
        marks["forward returned"] = time.perf_counter()
        torch.autograd.grad(out, (q, k, v), dout)
        marks["grad returned"] = time.perf_counter()

    order = ["start", "forward in", "forward out", "forward returned", "backward in", "backward out", "grad returned"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for threaded in (True, False):
        with torch.autograd.set_multithreading_enabled(threaded):
            step()
            torch.cuda.synchronize()
            sums = [0.0] * (len(order) - 1)
            calls = 200
            for _ in range(calls):
                step()
                for i in range(len(order) - 1):
                    sums[i] += marks[order[i + 1]] - marks[order[i]]
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(step, return_mode="median")
        print(f"\n{'worker' if threaded else 'calling'} thread: do_bench {ms * 1e3:.0f} us; host us between marks:")
        for i, total in enumerate(sums):
            print(f"  {order[i]} -> {order[i + 1]}: {1e6 * total / calls:.1f}")


if __name__ == "__main__":
    main()
