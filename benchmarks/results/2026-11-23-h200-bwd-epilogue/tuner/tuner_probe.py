"""Does the forward's tuner pick the fastest tile at T=1k? Per cell: four fresh tunings (their choice and times),
then each Hopper tile and cuDNN timed side by side in three rotating rounds (do_bench median, 100 ms).
    PYTHONPATH=$PWD python3 .gpu_carry/tuner_probe.py OUT_DIR"""
import datetime, json, statistics, sys
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from attention import triton_flash, triton_hopper

out_dir = sys.argv[1]
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
rows, lines = [], []
for B, H, T, D, causal in [(16, 16, 1024, 128, False), (16, 16, 1024, 128, True), (16, 32, 1024, 64, True),
                           (16, 12, 1024, 64, True), (16, 32, 1024, 64, False)]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = D ** -0.5
    tunings = []
    for _ in range(4):
        triton_flash._best_tile.clear(); triton_flash._plans.clear()
        triton_flash.tuning_log = []
        triton_flash.forward(q, k, v, causal, scale)
        entry = next(e for e in triton_flash.tuning_log if e["kernel"] == "fwd")
        times = sorted(((str(c), t) for c, t in entry["times_ms"].items()), key=lambda x: x[1])
        tunings.append(times[:4])
    o = torch.empty_like(q); lse = torch.empty(B, H, T, device="cuda", dtype=torch.float32)
    runs = {}
    for tile in triton_hopper.TILES[D]:
        launched = triton_hopper.forward(q, k, v, o, lse, causal, scale, tile)
        runs[str(tile)] = lambda launched=launched: launched.again(q, k, v, o, lse, scale)
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    runs["cudnn"] = cudnn
    names = list(runs)
    ms = {n: [] for n in names}
    for r in range(3):
        for n in names[r % len(names):] + names[:r % len(names)]:
            ms[n].append(triton.testing.do_bench(runs[n], rep=100, return_mode="median"))
    med = {n: statistics.median(v) for n, v in ms.items()}
    rows.append(dict(cell=(B, H, T, D, causal), tunings=tunings, rounds_ms=ms, median_ms=med, **meta))
    best = min((n for n in med if n != "cudnn"), key=med.get)
    lines.append(f"B{B} H{H} T{T} hs{D} {'causal' if causal else 'full'}: tuner picked "
                 f"{[t[0][0] for t in tunings]}; rounds: " + ", ".join(f"{n} {med['cudnn'] / med[n]:.3f}" for n in med if n != 'cudnn')
                 + f"; best {best}")
    print(lines[-1], flush=True)
json.dump(rows, open(f"{out_dir}/tuner_probe.json", "w"), indent=1, default=str)
open(f"{out_dir}/tuner_table.txt", "w").write("\n".join(lines) + "\n")
