"""Probe: every tile of the Hopper forward at hs=64 (attention/triton_hopper.py TILES, with the tiles in EXTRA added)
beside cuDNN's forward, per hs=64 grid cell: float64 checks of the EXTRA tiles (O and lse), then per cell each
tile's launch and cuDNN's forward in three rounds, the order rotating, do_bench median (100 ms). bf16.

    EXTRA="[(64, 3, True, 2), ...]" PYTHONPATH=$PWD python3 .../probe/fwd_tiles_probe.py OUT_DIR
"""
import ast
import datetime
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import triton_flash, triton_hopper

out_dir = sys.argv[1]
extra = ast.literal_eval(os.environ.get("EXTRA", "[]"))
tiles = triton_hopper.TILES[64] + extra
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def inputs(B, H, T):
    torch.manual_seed(0)
    return [torch.randn(B, H, T, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]


def outputs(q):
    B, H, T, D = q.shape
    return triton_flash.empty_bthd(B, H, T, D, q), torch.empty(B, H, T, device="cuda", dtype=torch.float32)


checks = []
for B, H, T, causal in [(3, 22, 1100, True), (3, 22, 1100, False), (2, 4, 50, True)]:
    q, k, v = inputs(B, H, T)
    mask = torch.ones(T, T, dtype=torch.bool, device="cuda").tril() if causal else None
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    math = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for tile in extra:
        o, lse = outputs(q)
        triton_hopper.forward(q, k, v, o, lse, causal, 64 ** -0.5, tile)
        err, bound = (o.double() - exact).abs().max().item(), 2 * (math.double() - exact).abs().max().item() + 1e-5
        checks.append(dict(shape=(B, H, T, causal), tile=tile, err=err, bound=bound, ok=err <= bound))
        print(json.dumps(checks[-1]), flush=True)
with open(f"{out_dir}/checks.json", "w") as f:
    json.dump(checks, f, indent=1)

CELLS = [(16, 12, 1024, True)] + [(16384 // T, 32, T, causal) for causal in (True, False) for T in (1024, 4096, 16384)]
rows = []
for B, H, T, causal in CELLS:
    q, k, v = inputs(B, H, T)
    o, lse = outputs(q)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    for tile in tiles:
        launched = triton_hopper.forward(q, k, v, o, lse, causal, 64 ** -0.5, tile)
        runs[str(tile)] = lambda launched=launched: launched.again(q, k, v, o, lse, 64 ** -0.5)
    times = {name: [] for name in runs}
    names = list(runs)
    for r in range(3):
        for name in names[r * 2 % len(names):] + names[:r * 2 % len(names)]:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                times[name].append(triton.testing.do_bench(runs[name], rep=100, return_mode="median"))
    for name, ts in times.items():
        rows.append(dict(B=B, H=H, T=T, causal=causal, name=name, ms=statistics.median(ts), rounds_ms=ts, **meta))
        print(json.dumps(rows[-1]), flush=True)
with open(f"{out_dir}/fwd_tiles.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)

lines = [f"float64 checks (EXTRA tiles): {sum(c['ok'] for c in checks)} of {len(checks)} passed",
         "cuDNN's forward time / ours, per tile (BLOCK_N, STAGES, PERSISTENT, CONSUMERS); best of TILES -> best of all"]
for B, H, T, causal in CELLS:
    cell = {r["name"]: r["ms"] for r in rows if (r["B"], r["H"], r["T"], r["causal"]) == (B, H, T, causal)}
    ratios = {name: cell["cudnn"] / ms for name, ms in cell.items() if name != "cudnn"}
    best = max(r for name, r in ratios.items() if ast.literal_eval(name) not in extra)
    lines.append(f"B{B} H{H} T{T} hs64 {'causal' if causal else 'full'} | "
                 + " ".join(f"{name}:{r:.3f}" for name, r in ratios.items())
                 + f" | best {best:.3f} -> {max(ratios.values()):.3f}")
with open(f"{out_dir}/fwd_tiles_table.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), file=sys.stderr)
