"""Probe: the Hopper forward with a last key tile taken by its first half (the package as it is) against the same
kernel without it (the package at BASE, imported as `attention_base`), tile for tile, beside cuDNN's forward, on the
grid's cells at hs=64 and hs=128. First float64 checks of every tile on shapes that take the half tile: the causal
mask (the first warpgroup's diagonal tile) and a last tile with fewer than half its keys (Tk = 1050). Then per cell
each kernel's tiles and cuDNN in three rounds, the order rotating, do_bench median (100 ms). bf16.

    PYTHONPATH=$PWD:$BASE_PARENT python3 .../probe/half_tile_probe.py OUT_DIR [HEAD_DIMS, default 64,128]
"""
import datetime
import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import triton_flash, triton_hopper
from attention_base import triton_hopper as base_hopper

out_dir = sys.argv[1]
head_dims = [int(d) for d in (sys.argv[2] if len(sys.argv) > 2 else "64,128").split(",")]
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def inputs(B, H, Tq, Tk, D):
    torch.manual_seed(0)
    return [torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for T in (Tq, Tk, Tk)]


def outputs(q):
    B, H, T, D = q.shape
    return triton_flash.empty_bthd(B, H, T, D, q), torch.empty(B, H, T, device="cuda", dtype=torch.float32)


checks = []
for B, H, Tq, Tk, causal in [(3, 22, 1100, 1100, True), (2, 8, 1000, 1050, False), (2, 8, 700, 1050, True),
                             (1, 4, 50, 50, True)]:
    for D in head_dims:
        q, k, v = inputs(B, H, Tq, Tk, D)
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device="cuda").tril(Tk - Tq) if causal else None
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
        math = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        for tile in triton_hopper.TILES[D]:
            o, lse = outputs(q)
            triton_hopper.forward(q, k, v, o, lse, causal, D ** -0.5, tile)
            err, bound = (o.double() - exact).abs().max().item(), 2 * (math.double() - exact).abs().max().item() + 1e-5
            checks.append(dict(shape=(B, H, Tq, Tk, D, causal), tile=tile, err=err, bound=bound, ok=err <= bound))
            print(json.dumps(checks[-1]), flush=True)
with open(f"{out_dir}/checks.json", "w") as f:
    json.dump(checks, f, indent=1)

CELLS = [(16, 12, 1024, 64, True)] + [(16384 // T, 2048 // D, T, D, causal) for D in head_dims
                                      for causal in (True, False) for T in (1024, 4096, 16384)]
rows = []
for B, H, T, D, causal in CELLS:
    q, k, v = inputs(B, H, T, T, D)
    o, lse = outputs(q)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    for name, module in (("half", triton_hopper), ("base", base_hopper)):
        for tile in triton_hopper.TILES[D]:
            launched = module.forward(q, k, v, o, lse, causal, D ** -0.5, tile)
            runs[f"{name} {tile}"] = lambda launched=launched: launched.again(q, k, v, o, lse, D ** -0.5)
    times = {name: [] for name in runs}
    names = list(runs)
    for r in range(3):
        for name in names[r * 3 % len(names):] + names[:r * 3 % len(names)]:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                times[name].append(triton.testing.do_bench(runs[name], rep=100, return_mode="median"))
    for name, ts in times.items():
        rows.append(dict(B=B, H=H, T=T, D=D, causal=causal, name=name, ms=statistics.median(ts), rounds_ms=ts,
                         **meta))
        print(json.dumps(rows[-1]), flush=True)
with open(f"{out_dir}/half_tile.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)

lines = [f"float64 checks: {sum(c['ok'] for c in checks)} of {len(checks)} passed",
         "cuDNN's forward time / ours, tile for tile (BLOCK_N, STAGES, PERSISTENT, CONSUMERS): base -> half; "
         "best base -> best half"]
for B, H, T, D, causal in CELLS:
    cell = {r["name"]: r["ms"] for r in rows if (r["B"], r["H"], r["T"], r["D"], r["causal"]) == (B, H, T, D, causal)}
    ratio = {name: cell["cudnn"] / ms for name, ms in cell.items() if name != "cudnn"}
    per_tile = " ".join(f"{tile}:{ratio[f'base {tile}']:.3f}->{ratio[f'half {tile}']:.3f}"
                        for tile in triton_hopper.TILES[D])
    best = {name: max(r for n, r in ratio.items() if n.startswith(name)) for name in ("base", "half")}
    lines.append(f"B{B} H{H} T{T} hs{D} {'causal' if causal else 'full'} | {per_tile} | "
                 f"best {best['base']:.3f} -> {best['half']:.3f}")
with open(f"{out_dir}/half_tile_table.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), file=sys.stderr)
