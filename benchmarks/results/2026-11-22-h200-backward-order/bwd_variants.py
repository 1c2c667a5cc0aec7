"""Timing-only probe: variants of the Gluon backward (.gpu_carry/hbv_*.py) side by side with the tl backward and cuDNN."""
import importlib, json, os, sys, time
import torch, triton, triton.testing
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
sys.path.insert(0, ".gpu_carry")
from attention import triton_flash
OUT = os.environ.get("OUT", "out")
variants = {v: importlib.import_module("hbv_" + v) for v in sys.argv[1].split(",")}
dev = "cuda"
x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16); t0 = time.time()
while time.time() - t0 < 2: x @ x
rows = []
# shape sets by name (second argument): this session's, the earlier session's (../2026-11-22-h200-hopper-backward/,
# run with that session's copy of this probe, without the sanity column), the benchmark grid's seven hs=64 cells
SHAPES = {
    "default": [(16, 12, 1024, 64, True), (16, 32, 1024, 64, False), (4, 32, 4096, 64, True), (4, 32, 4096, 64, False),
                (1, 32, 16384, 64, False), (1, 32, 16384, 64, True), (16, 16, 1024, 128, True),
                (4, 16, 4096, 128, True), (1, 16, 16384, 128, False)],
    "hopper-backward": [(16, 12, 1024, 64, True), (4, 32, 4096, 64, True), (1, 32, 16384, 64, False),
                        (1, 32, 16384, 64, True), (4, 16, 4096, 128, True), (1, 16, 16384, 128, False)],
    "hs64-grid": [(16, 12, 1024, 64, True), (16, 32, 1024, 64, True), (4, 32, 4096, 64, True), (1, 32, 16384, 64, True),
                  (16, 32, 1024, 64, False), (4, 32, 4096, 64, False), (1, 32, 16384, 64, False)],
}
shapes = SHAPES[sys.argv[2] if len(sys.argv) > 2 else "default"]
for B, H, T, D, causal in shapes:
    mk = lambda: torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    q, k, v, do = mk(), mk(), mk(), mk()
    scale = D ** -0.5
    o, lse = triton_flash.forward(q, k, v, causal, scale)
    grads = [triton_flash.empty_bthd(*t.shape, t) for t in (q, k, v)]
    row = dict(B=B, H=H, T=T, D=D, causal=causal)
    reference = triton_flash.backward(do, q, k, v, o, lse, causal, scale)  # the tl kernels' dq, dk, dv
    for name, mod in variants.items():
        for st in mod.TILES.get(D, []):
            try:
                mine = [torch.full_like(g, float("nan")) for g in grads]
                mod.backward(do, q, k, v, o, lse, *mine, causal, scale, st)
                # sanity (the float64 checks are the GPU tests'): largest difference from the tl gradients / their largest
                row[f"{name}_s{st}_err"] = max(((a.float() - r.float()).abs().max() / r.float().abs().max()).item() for a, r in zip(mine, reference))
                row[f"{name}_s{st}"] = triton.testing.do_bench(lambda: mod.backward(do, q, k, v, o, lse, *grads, causal, scale, st), warmup=50, rep=300)
            except Exception as e:
                row[f"{name}_s{st}"] = repr(e)[:200]
    row["tl"] = triton.testing.do_bench(lambda: triton_flash.backward(do, q, k, v, o, lse, causal, scale, grads=grads), warmup=50, rep=300)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        row["cudnn"] = triton.testing.do_bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True), warmup=50, rep=300)
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=rows), open(os.path.join(OUT, "bwd_variants.json"), "w"), indent=1)
for r in rows:
    print((r["B"], r["H"], r["T"], r["D"], r["causal"]), " ".join(f"{k}={r['cudnn']/v:.2f}" if not k.endswith("_err") else f"{k}={v:.1e}" for k, v in r.items() if isinstance(v, float)))
