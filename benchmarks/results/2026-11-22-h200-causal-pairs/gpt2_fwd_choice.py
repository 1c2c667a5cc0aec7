"""At GPT-2's shape: which forward the tuner takes, each candidate's tuner time, and the forward through the public
API (requires_grad inputs, as the benchmark) with the tuner choosing vs the Hopper kernel switched off."""
import time, torch, triton, triton.testing
from attention import attention, triton_flash
triton_flash.tuning_log = []
B, H, T, D = 16, 12, 1024, 64
q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
f = lambda: attention(q, k, v, True, backend="triton")
for mode in ("auto", "0"):
    triton_flash.HOPPER_MODE = mode
    triton_flash._best_tile.clear()
    triton_flash.tuning_log.clear()
    f(); torch.cuda.synchronize()
    for entry in triton_flash.tuning_log:
        times = sorted(entry["times_ms"].items(), key=lambda kv: kv[1])[:5]
        print(mode, entry["kernel"], [(str(c), round(t, 4)) for c, t in times])
    ms = [triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median") for _ in range(3)]
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(200): f()
    host = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    print(f"HOPPER_MODE={mode}: forward via the API {[round(m, 4) for m in ms]} ms, host per call {host:.0f} us", flush=True)
