"""Probe: the Hopper backward with warpgroup 1 computing each tile's dQ half one tile late (hbv_offset: the two
consumers out of step), and the same with one dQ staging tile per warpgroup (hbv_offset1, which lets hs=128 take a
third ring slot), against the committed kernel (hbv_committed) and cuDNN, side by side. Backward only (pre-pass,
main kernel, post-pass), bf16, the grid's cells and GPT-2's. PROBE_CHECK=1 first runs the GPU tests' float64 check
on every variant and stage count."""
import json, os, sys, time
import torch, triton, triton.testing
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
sys.path.insert(0, os.path.dirname(__file__))
from attention import triton_flash, triton_hopper_backward as package
import hbv_committed, hbv_offset, hbv_offset1, hbv_staging1, hbv_late, hbv_pbf16, hbv_offset_late, hbv_lag64

VARIANTS = dict(committed=hbv_committed, offset=hbv_offset, offset1=hbv_offset1, staging1=hbv_staging1, late=hbv_late,
                pbf16=hbv_pbf16, offset_late=hbv_offset_late, package=package,
                lag64=hbv_lag64)
if os.environ.get("PROBE_VARIANTS"):
    VARIANTS = {n: VARIANTS[n] for n in os.environ["PROBE_VARIANTS"].split(",")}
OUT = os.environ.get("OUT", "out")
dev = "cuda"
torch.manual_seed(0)


def make(B, H, T, D):
    # the model's layout: (B, T, H, D) storage viewed as (B, H, T, D)
    return [torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16).transpose(1, 2) for _ in range(4)]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150)


def cell(B, H, T, D, causal, rounds=int(os.environ.get('PROBE_ROUNDS', '3'))):
    q, k, v, do = make(B, H, T, D)
    scale = D ** -0.5
    o, lse = triton_flash.forward(q, k, v, causal, scale)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
    runs = {"cudnn": lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)}
    for name, mod in VARIANTS.items():
        for s in mod.TILES[D]:
            skip = os.environ.get("PROBE_SKIP", "").split(",")
            if f"{name}_s{s}" in skip or f"{name}_s{s}@{D}" in skip or f"{name}@{D}" in skip:
                continue
            runs[f"{name}_s{s}"] = lambda mod=mod, s=s: mod.backward(do, q, k, v, o, lse, *grads, causal, scale, s)
    times = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):  # each round in another order: the clocks may drop over a long run (power cap)
        for name in (names[r % len(names):] + names[:r % len(names)])[::(-1) ** r]:
            times[name].append(bench(runs[name]))
    row = dict(B=B, H=H, T=T, D=D, causal=causal, ms={n: sorted(t)[len(t) // 2] for n, t in times.items()}, all_ms=times)
    c = row["ms"]["cudnn"]
    row["vs_cudnn"] = {n: c / t for n, t in row["ms"].items() if n != "cudnn"}
    return row


x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16); t0 = time.time()
while time.time() - t0 < 2: x @ x
torch.cuda.synchronize()
if os.environ.get("PROBE_CHECK") == "1":  # every variant against float64, as the GPU tests do
    sys.path.insert(0, "tests")
    import test_triton_hopper_backward as tests
    for name, mod in VARIANTS.items():
        if name not in os.environ.get("PROBE_CHECK_VARIANTS", "").split(","):  # the GPU tests cover the committed one
            continue
        tests.triton_hopper_backward = mod
        for D, stage_counts in mod.TILES.items():
            for s in stage_counts:
                for case in tests.CASES:
                    tests.check_against_fp64(*case, D, s)
                print("CHECK OK", name, D, s, flush=True)
shapes = [(16, 12, 1024, 64, True)]
for D in (64, 128):
    for causal in (True, False):
        for T in (1024, 4096, 16384):
            shapes.append((16384 // T, 2048 // D, T, D, causal))
if len(sys.argv) > 1:
    shapes = [s for s in shapes if str(s[3]) in sys.argv[1].split(",")]
results = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=[])
for s in shapes:
    row = cell(*s)
    results["rows"].append(row)
    print("ROW", json.dumps(row), flush=True)
    json.dump(results, open(os.path.join(OUT, os.environ.get("PROBE_NAME", "bwd_offset") + ".json"), "w"), indent=1)
print(f"{'B,H,T,D,causal':26s} cudnn_ms  " + "  ".join(f"{n:>12s}" for n in results["rows"][0]["vs_cudnn"]))
for r in results["rows"]:
    print(f"{str((r['B'], r['H'], r['T'], r['D'], r['causal'])):26s} {r['ms']['cudnn']:8.3f}  "
          + "  ".join(f"{r['vs_cudnn'].get(n, float('nan')):12.3f}" for n in results["rows"][0]["vs_cudnn"]))
