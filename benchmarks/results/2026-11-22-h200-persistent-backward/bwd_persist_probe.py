"""Probe: the Hopper backward with a persistent grid walking pairs of key tiles (and a program per key tile in a
head's order) against the committed one (programs in head groups, hbv_grouped.py) and the item loop in the committed
order (hbv_pgrouped.py), and cuDNN, side by side (README.md: where the two modules come from).
Backward only (pre-pass, main kernel, post-pass), bf16, the grid's cells and GPT-2's."""
import json, os, sys, time
import torch, triton, triton.testing
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
sys.path.insert(0, os.path.dirname(__file__))
from attention import triton_flash, triton_hopper_backward as new
import hbv_grouped as old
import hbv_pgrouped as pgr

OUT = os.environ.get("OUT", "out")
dev = "cuda"
torch.manual_seed(0)


def make(B, H, T, D):
    # the model's layout: (B, T, H, D) storage viewed as (B, H, T, D)
    return [torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16).transpose(1, 2) for _ in range(4)]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150)


def cell(B, H, T, D, causal, rounds=int(os.environ.get('PROBE_ROUNDS', '2'))):
    q, k, v, do = make(B, H, T, D)
    scale = D ** -0.5
    o, lse = triton_flash.forward(q, k, v, causal, scale)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
    runs = {"cudnn": lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)}
    for s in old.TILES[D]:
        runs[f"grouped_s{s}"] = lambda s=s: old.backward(do, q, k, v, o, lse, *grads, causal, scale, s)
    for s, p in new.TILES[D]:
        if (p or os.environ.get("PROBE_EACH") == "1") and os.environ.get("PROBE_HEAD_ORDER", "1") == "1":
            runs[f"{'pers' if p else 'each'}_s{s}"] = lambda t=(s, p): new.backward(do, q, k, v, o, lse, *grads, causal, scale, t)
        runs[f"{'gpers' if p else 'geach'}_s{s}"] = lambda t=(s, p): pgr.backward(do, q, k, v, o, lse, *grads, causal, scale, t)
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
if os.environ.get("PROBE_CHECK") == "1":  # the grouped persistent variant against float64, as the GPU tests do
    sys.path.insert(0, "tests")
    import test_triton_hopper_backward as tests
    tests.triton_hopper_backward = pgr
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for D in (64, 128):
        for tile in pgr.TILES[D]:
            tests.check_against_fp64(torch.bfloat16, True, 3, 2 * (sms // 4 * 2 + 1), sms // 4 * 2 + 1, 300, 300, D, tile, launches=5)
            tests.check_against_fp64(torch.bfloat16, False, 2, 8, 4, 1000, 777, D, tile, launches=2)
            tests.check_against_fp64(torch.float16, True, 2, 4, 2, 300, 1000, D, tile)
            print("CHECK OK", D, tile, flush=True)
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
    json.dump(results, open(os.path.join(OUT, os.environ.get("PROBE_NAME", "bwd_persist") + ".json"), "w"), indent=1)
print(f"{'B,H,T,D,causal':26s} cudnn_ms  " + "  ".join(f"{n:>11s}" for n in results["rows"][0]["vs_cudnn"]))
for r in results["rows"]:
    print(f"{str((r['B'], r['H'], r['T'], r['D'], r['causal'])):26s} {r['ms']['cudnn']:8.3f}  "
          + "  ".join(f"{v:11.3f}" for v in r["vs_cudnn"].values()))
