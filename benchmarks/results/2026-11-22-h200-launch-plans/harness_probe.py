"""The GPT-2 cell's forward+backward timed by the grid's measure() and by plans_probe's loop, alternating in one
process: do the two harnesses disagree, or the processes?"""
import statistics, time
import torch, triton
from benchmarks.attention import GPT2_SHAPE, forced_sdpa_backend, measure, registry_backend, pass_step, warm_up_gpu

shape = GPT2_SHAPE
fns = {"sdpa-cudnn": forced_sdpa_backend("sdpa-cudnn"), "triton": registry_backend("triton")}
q, k, v = (torch.randn(16, 12, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn_like(q)

def host_us(step, calls=200):
    times = []
    for i in range(calls):
        if i % 25 == 0:
            torch.cuda.synchronize()
        t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)

warm_up_gpu(torch.device("cuda"))
for rnd in range(4):
    for name, fn in fns.items():
        grid = measure(fn, shape, ["bwd", "fwd+bwd"], torch.bfloat16, torch.device("cuda"), 100.0)
        step = pass_step(fn, "fwd+bwd", q, k, v, dout, True)
        step()
        plain = triton.testing.do_bench(step, rep=100, return_mode="median")
        with_grads = triton.testing.do_bench(step, rep=100, grad_to_none=(q, k, v), return_mode="median")
        print(f"round {rnd} {name:10s} measure(): bwd {grid['bwd']['ms']:.3f} fwd+bwd {grid['fwd+bwd']['ms']:.3f} | "
              f"do_bench fwd+bwd {plain:.3f}, with grad_to_none {with_grads:.3f} | host {host_us(step):.0f} us", flush=True)
