"""Probe: the Hopper forward (§12) with three consumer warpgroups (192 query rows per work item, FA3's tile at
head dim 64) against the package's two, at hs=64. triton_hopper_wg3.py (wg3.patch in this directory, applied to
a06fbcd's attention/triton_hopper.py) is the package's kernel with a consumer count: a tile (BLOCK_N, STAGES, PERSISTENT, CONSUMERS), 128 launch
registers and 160 per consumer thread with three (16 warps: 3 x 4 consumers, the producer's warp padded to 4).
First float64 checks of every three-consumer tile on odd shapes, then forward times beside cuDNN (do_bench median
over three rounds in rotating order), the package's tiles and its tuner's choice too. bf16.

    git show a06fbcd:attention/triton_hopper.py | sed 's/^from .launch/from attention.launch/' > .gpu_carry/triton_hopper_wg3.py
    patch .gpu_carry/triton_hopper_wg3.py benchmarks/results/2026-11-22-h200-three-consumers/wg3.patch
    PYTHONPATH=$PWD python3 benchmarks/results/2026-11-22-h200-three-consumers/wg3_probe.py OUT_DIR
"""
import datetime
import importlib.util
import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import attention, triton_flash, triton_hopper

spec = importlib.util.spec_from_file_location("wg3", ".gpu_carry/triton_hopper_wg3.py")
wg3 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wg3)

out_dir = sys.argv[1]
WG3_TILES = [(128, 3, True, 3), (128, 3, False, 3), (128, 2, True, 3), (64, 3, True, 3), (64, 3, False, 3)]
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

# float64 checks: ragged, Tq < Tk, Tq > Tk (rows that see no key), shorter than a tile, GQA, more items than SMs
checks = []
for B, Hq, Hkv, Tq, Tk, causal in [(2, 4, 4, 1000, 1000, True), (2, 4, 2, 300, 1000, True), (2, 4, 2, 1000, 300, True),
                                   (1, 2, 2, 50, 50, False), (1, 131, 131, 300, 300, True), (4, 8, 2, 1000, 1000, False)]:
    torch.manual_seed(0)
    q = torch.randn(B, Hq, Tq, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, Tk, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kr, vr = (t.repeat_interleave(Hq // Hkv, 1) for t in (k, v))
    mask = torch.ones(Tq, Tk, dtype=torch.bool, device="cuda").tril(Tk - Tq) if causal else None
    exact = F.scaled_dot_product_attention(q.double(), kr.double(), vr.double(), attn_mask=mask)
    math = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
    seen = mask.any(-1)[None, None, :, None] if causal else torch.ones(1, dtype=torch.bool, device="cuda")
    exact, math = exact.nan_to_num(0.0) * seen, math.nan_to_num(0.0) * seen  # rows that see no key: O = 0
    bound = 2 * (math.double() - exact).abs().max().item() + 1e-5
    for tile in WG3_TILES:
        o = torch.full_like(q, float("nan"))
        lse = torch.empty(B, Hq, Tq, device="cuda")
        for _ in range(5):
            wg3.forward(q, k, v, o, lse, causal, 64 ** -0.5, tile)
        err = (o.double() - exact).abs().max().item()
        checks.append(dict(shape=(B, Hq, Hkv, Tq, Tk, causal), tile=tile, err=err, bound=bound, ok=err <= bound))
        print(json.dumps(checks[-1]), flush=True)
with open(f"{out_dir}/checks.json", "w") as f:
    json.dump(checks, f, indent=1)

CELLS = [(16, 12, 1024, 64, True)] + [(16384 // T, 32, T, 64, causal) for causal in (True, False)
                                      for T in (1024, 4096, 16384)]
rows = []
for B, H, T, D, causal in CELLS:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o, lse = triton_flash.empty_bthd(B, H, T, D, q), torch.empty(B, H, T, device="cuda")
    runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    for tile in triton_hopper.TILES[D]:
        runs[f"two{tile}"] = lambda tile=tile: triton_hopper.forward(q, k, v, o, lse, causal, D ** -0.5, tile)
    for tile in WG3_TILES:
        runs[f"three{tile}"] = lambda tile=tile: wg3.forward(q, k, v, o, lse, causal, D ** -0.5, tile)
    runs["package"] = lambda: attention(q, k, v, causal=causal, backend="triton")
    times, diffs = {name: [] for name in runs}, {}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
        for name, fn in runs.items():
            o.fill_(float("nan"))
            result = fn()
            out = result if name in ("cudnn", "package") else o
            diffs[name] = (out.float() - ref.float()).abs().max().item()
        names = list(runs)
        for r in range(3):
            for name in names[r * 3 % len(names):] + names[:r * 3 % len(names)]:
                times[name].append(triton.testing.do_bench(runs[name], rep=100, return_mode="median"))
    for name in runs:
        row = dict(B=B, H=H, T=T, D=D, causal=causal, name=name, ms=statistics.median(times[name]),
                   rounds_ms=times[name], max_diff_vs_cudnn=diffs[name], **meta)
        rows.append(row)
        print(json.dumps(row), flush=True)
with open(f"{out_dir}/wg3.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)

lines = ["cell | cudnn ms | two best (tile) | three best (tile) | package | max diff | float64 checks"]
ok = all(c["ok"] for c in checks)
for B, H, T, D, causal in CELLS:
    cell = {r["name"]: r for r in rows if (r["B"], r["H"], r["T"], r["causal"]) == (B, H, T, causal)}
    cudnn = cell["cudnn"]["ms"]
    best = {kind: min((r for n, r in cell.items() if n.startswith(kind)), key=lambda r: r["ms"]) for kind in ("two", "three")}
    lines.append(f"B{B} H{H} T{T} hs{D} {'causal' if causal else 'full'} | {cudnn:.4f} | "
                 f"{cudnn / best['two']['ms']:.3f} {best['two']['name'][3:]} | "
                 f"{cudnn / best['three']['ms']:.3f} {best['three']['name'][5:]} | {cudnn / cell['package']['ms']:.3f} | "
                 f"{max(r['max_diff_vs_cudnn'] for r in cell.values()):.4f} | {'all passed' if ok else 'FAILED'}")
with open(f"{out_dir}/wg3_table.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), file=sys.stderr)
