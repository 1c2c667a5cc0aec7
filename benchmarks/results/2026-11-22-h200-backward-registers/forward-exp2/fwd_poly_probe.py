"""Probe: the Hopper forward with one exp2 in four computed by a polynomial on the FMA pipe (hfv_poly) against the
committed forward (attention.triton_hopper) and cuDNN, side by side, every tile of each; forward only, bf16, the
grid's cells and GPT-2's. PROBE_CHECK=1 first runs the GPU tests' float64 checks on the variant."""
import json, os, sys, time
import torch, triton, triton.testing
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
sys.path.insert(0, os.path.dirname(__file__))
from attention import triton_hopper as committed, triton_flash
import hfv_poly as poly

OUT = os.environ.get("OUT", "out")
dev = "cuda"


def make(B, H, T, D):
    return [torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]


def cell(B, H, T, D, causal, rounds=3):
    q, k, v = make(B, H, T, D)
    o = torch.empty_like(q)
    lse = torch.empty(B, H, T, device=dev, dtype=torch.float32)
    scale = D ** -0.5
    runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    for name, mod in (("committed", committed), ("poly", poly)):
        for tile in mod.TILES[D]:
            runs[f"{name}_{tile[0]}_{tile[1]}{'p' if tile[2] else ''}"] = (
                lambda mod=mod, tile=tile: mod.forward(q, k, v, o, lse, causal, scale, tile))
    times = {name: [] for name in runs}
    names = list(runs)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for r in range(rounds):
            for name in (names[r % len(names):] + names[:r % len(names)])[::(-1) ** r]:
                times[name].append(triton.testing.do_bench(runs[name], warmup=25, rep=100))
    ms = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    best = lambda p: max(ms["cudnn"] / t for n, t in ms.items() if n.startswith(p))  # noqa: E731
    return dict(B=B, H=H, T=T, D=D, causal=causal, ms=ms, all_ms=times,
                vs_cudnn={n: ms["cudnn"] / t for n, t in ms.items() if n != "cudnn"},
                best=dict(committed=best("committed"), poly=best("poly")))


x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16); t0 = time.time()
while time.time() - t0 < 2: x @ x
torch.cuda.synchronize()
if os.environ.get("PROBE_CHECK") == "1":
    from _pytest.monkeypatch import MonkeyPatch
    sys.path.insert(0, "tests")
    import test_triton_hopper as th
    th.triton_hopper = poly
    mp = MonkeyPatch()
    mp.setattr(triton_flash, "triton_hopper", poly)
    for case in th.CASES:
        th.test_matches_fp64_forward_and_backward(mp, *case)
    for D, tiles in poly.TILES.items():
        for tile in tiles:
            for causal in (True, False):
                th.test_every_tile_matches_fp64(mp, D, tile, causal)
    mp.undo()
    print("CHECK OK", flush=True)
shapes = [(16, 12, 1024, 64, True)]
for D in (64, 128):
    for causal in (True, False):
        for T in (1024, 4096, 16384):
            shapes.append((16384 // T, 2048 // D, T, D, causal))
results = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=[])
for s in shapes:
    row = cell(*s)
    results["rows"].append(row)
    json.dump(results, open(os.path.join(OUT, "fwd_poly.json"), "w"), indent=1)
    print(f"{str(s):28s} cudnn {row['ms']['cudnn']:.3f} ms  best committed {row['best']['committed']:.3f}  "
          f"best poly {row['best']['poly']:.3f}", flush=True)
