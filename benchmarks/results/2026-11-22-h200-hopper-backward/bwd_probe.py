"""Probe: the Gluon backward (attention/triton_hopper_backward.py) vs float64, vs our tl backward and cuDNN."""
import json, math, os, sys, time, subprocess
import torch, triton, triton.testing
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F
from attention import triton_flash, triton_hopper_backward as hb

OUT = os.environ.get("OUT", "out")
dev = "cuda"
torch.manual_seed(0)

def make(B, Hq, Hkv, Tq, Tk, D, dtype=torch.bfloat16):
    # the model's layout: (B, T, H, D) storage viewed as (B, H, T, D)
    q = torch.randn(B, Tq, Hq, D, device=dev, dtype=dtype).transpose(1, 2)
    k = torch.randn(B, Tk, Hkv, D, device=dev, dtype=dtype).transpose(1, 2)
    v = torch.randn(B, Tk, Hkv, D, device=dev, dtype=dtype).transpose(1, 2)
    do = torch.randn(B, Tq, Hq, D, device=dev, dtype=dtype).transpose(1, 2)
    return q, k, v, do

from attention import attention

def grads_of(q, k, v, do, causal, scale):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, causal, scale, backend="naive")
    return torch.autograd.grad(out, (q, k, v), do)

def check(B, Hq, Hkv, Tq, Tk, D, causal, stages):
    q, k, v, do = make(B, Hq, Hkv, Tq, Tk, D)
    scale = D ** -0.5
    o, lse = triton_flash.forward(q, k, v, causal, scale)
    dq, dk, dv = (triton_flash.empty_bthd(*t.shape, t) for t in (q, k, v))
    hb.backward(do, q, k, v, o, lse, dq, dk, dv, causal, scale, stages)
    ours = (dq, dk, dv)
    tl_grads = triton_flash.backward(do, q, k, v, o, lse, causal, scale)
    ref = grads_of(q.double(), k.double(), v.double(), do.double(), causal, scale)
    math = grads_of(q, k, v, do, causal, scale)
    out = {}
    for name, a, t, r, p in zip("q k v".split(), ours, tl_grads, ref, math):
        out["d" + name] = dict(ours=(a.double() - r).abs().max().item(), tl=(t.double() - r).abs().max().item(),
                               math=(p.double() - r).abs().max().item(), nan=bool(a.isnan().any()))
    ok = all(e["ours"] <= 2 * e["math"] + 1e-5 and not e["nan"] for e in out.values())
    return ok, out

results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "checks": [], "timings": []}
cases = [(1, 2, 2, 128, 128, 64, False), (2, 4, 2, 200, 200, 64, True), (1, 2, 1, 100, 300, 128, True),
         (1, 2, 2, 300, 100, 128, True), (2, 3, 3, 1000, 1000, 128, False), (1, 2, 2, 1024, 1024, 64, True),
         (2, 4, 4, 777, 777, 128, True), (1, 3, 1, 515, 515, 64, False)]
all_ok = True
for c in cases:
    for st in hb.TILES[c[5]]:
        try:
            ok, out = check(*c, st)
        except Exception as e:
            ok, out = False, {"error": repr(e)[:400]}
        all_ok &= ok
        results["checks"].append(dict(case=c, stages=st, ok=ok, **out))
        print("CHECK", c, st, "OK" if ok else "FAIL", json.dumps(out), flush=True)

def bench_case(B, H, T, D, causal):
    q, k, v, do = make(B, H, H, T, T, D)
    scale = D ** -0.5
    o, lse = triton_flash.forward(q, k, v, causal, scale)
    row = dict(B=B, H=H, T=T, D=D, causal=causal)
    grads = [triton_flash.empty_bthd(*t.shape, t) for t in (q, k, v)]
    for st in hb.TILES[D]:
        row[f"gluon_s{st}"] = triton.testing.do_bench(lambda: hb.backward(do, q, k, v, o, lse, *grads, causal, scale, st), warmup=50, rep=300)
    row["tl"] = triton.testing.do_bench(lambda: triton_flash.backward(do, q, k, v, o, lse, causal, scale, grads=grads), warmup=50, rep=300)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        row["cudnn"] = triton.testing.do_bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True), warmup=50, rep=300)
    best = min(v for k_, v in row.items() if k_.startswith("gluon"))
    row["gluon_vs_cudnn"] = row["cudnn"] / best
    row["tl_vs_cudnn"] = row["cudnn"] / row["tl"]
    return row

# warm the GPU
x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16); t0 = time.time()
while time.time() - t0 < 2: x @ x
torch.cuda.synchronize()
shapes = [(16, 12, 1024, 64, True)]
for D in (64, 128):
    for causal in (True, False):
        for T in (1024, 4096, 16384):
            shapes.append((16384 // T, 2048 // D, T, D, causal))
for s in (shapes if os.environ.get('PROBE_TIMINGS', '1') == '1' else []):
    try:
        row = bench_case(*s)
    except Exception as e:
        row = dict(shape=s, error=repr(e)[:300])
    results["timings"].append(row)
    print("TIME", json.dumps(row), flush=True)
    json.dump(results, open(os.path.join(OUT, "bwd_probe.json"), "w"), indent=1)
print("ALL_OK", all_ok)
print(f"{'shape':34s} {'gluon':>8s} {'tl':>8s} {'cudnn':>8s} {'g/cud':>6s} {'tl/cud':>6s}")
for r in results["timings"]:
    if "error" in r: print(r); continue
    best = min(v for k_, v in r.items() if k_.startswith("gluon"))
    print(f"{str((r['B'],r['H'],r['T'],r['D'],r['causal'])):34s} {best:8.3f} {r['tl']:8.3f} {r['cudnn']:8.3f} {r['gluon_vs_cudnn']:6.2f} {r['tl_vs_cudnn']:6.2f}")
