"""Where the Hopper backward's time goes: GPU time per call of its three kernels (pre-pass, main, post-pass) under
torch.profiler, at the grid's shapes, with cuDNN's backward kernels beside it. Run from the repo root:
PYTHONPATH=. python3 benchmarks/results/2026-11-22-h200-backward-order/bwd_split_probe.py"""
import json, os, time
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from torch.profiler import ProfilerActivity, profile
from attention import triton_flash, triton_hopper_backward

OUT = os.environ.get("OUT", "out")
CALLS = 20


def kernel_ms(fn) -> dict:
    """GPU ms per call of each kernel fn launches (mean over CALLS calls, after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:60]
            times[name] = times.get(name, 0.0) + event.time_range.elapsed_us() / 1000 / CALLS
    return times


rows = []
shapes = [(16, 12, 1024, 64, True), (16, 32, 1024, 64, True), (4, 32, 4096, 64, True), (1, 32, 16384, 64, True),
          (16, 32, 1024, 64, False), (4, 32, 4096, 64, False), (1, 32, 16384, 64, False), (16, 16, 1024, 128, True),
          (4, 16, 4096, 128, True), (1, 16, 16384, 128, False)]
for B, H, T, D, causal in shapes:
    mk = lambda: torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    q, k, v, do = mk(), mk(), mk(), mk()
    scale = D ** -0.5
    o, lse = triton_flash.forward(q, k, v, causal, scale)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    stages = triton_hopper_backward.TILES[D][0]
    ours = kernel_ms(lambda: triton_hopper_backward.backward(do, q, k, v, o, lse, *grads, causal, scale, stages))
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        cudnn = kernel_ms(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
    row = dict(B=B, H=H, T=T, D=D, causal=causal, ours_ms=ours, cudnn_ms=cudnn)
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=rows),
          open(os.path.join(OUT, "bwd_split.json"), "w"), indent=1)
print("| B, H, T, hs, causal | ours: pre / main / post ms | cuDNN: kernels ms | pre+post share |")
for r in rows:
    ours, cud = r["ours_ms"], r["cudnn_ms"]
    pre = sum(v for n, v in ours.items() if "prepare" in n)
    main = sum(v for n, v in ours.items() if "_ws" in n)
    post = sum(v for n, v in ours.items() if "finish" in n)
    print(f"| {r['B']}, {r['H']}, {r['T']}, {r['D']}, {r['causal']} | {pre:.3f} / {main:.3f} / {post:.3f} | "
          + " + ".join(f"{v:.3f}" for v in sorted(cud.values(), reverse=True)) + f" | {(pre + post) / (pre + main + post):.0%} |")
