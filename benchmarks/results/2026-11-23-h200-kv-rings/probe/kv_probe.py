"""Probe: the Hopper forward with K and V in rings of their own, K loaded a tile ahead and released once its S is
computed (the package as it is), against HEAD's kernel with one ring for both (the package at BASE, imported as
`attention_base`), tile for tile, beside cuDNN's forward, on the grid's cells. The package's tiles are (BLOCK_N,
K_STAGES, V_STAGES, PERSISTENT, CONSUMERS), HEAD's (BLOCK_N, STAGES, PERSISTENT, CONSUMERS); the new one, hs=128
(128, 3, 2, persistent, 2), has O's staging tiles where 3 + 3 slots left no room for them. First float64 checks of
every package tile on odd shapes (GQA, Tq != Tk, ragged last tiles, one tile); then per cell every tile of both and
cuDNN in three rounds, the order rotating, do_bench median (100 ms). bf16.

    PYTHONPATH=$PWD:$BASE_PARENT python3 .../probe/kv_probe.py OUT_DIR [HEAD_DIMS, default 128,64]
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
head_dims = [int(d) for d in (sys.argv[2] if len(sys.argv) > 2 else "128,64").split(",")]
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def inputs(B, Hq, Hkv, Tq, Tk, D):
    torch.manual_seed(0)
    return [torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for H, T in ((Hq, Tq), (Hkv, Tk), (Hkv, Tk))]


def outputs(q):
    B, H, T, D = q.shape
    return triton_flash.empty_bthd(B, H, T, D, q), torch.empty(B, H, T, device="cuda", dtype=torch.float32)


def base_tile(tile):
    """The package's tile -> HEAD's with the same ring, or None (the new tile)."""
    block_n, k_stages, v_stages, persistent, consumers = tile
    return (block_n, k_stages, persistent, consumers) if k_stages == v_stages else None


checks = []
for B, Hq, Hkv, Tq, Tk, causal in [(3, 22, 22, 1100, 1100, True), (2, 8, 2, 1000, 1050, False),
                                   (2, 8, 4, 700, 1050, True), (1, 4, 4, 50, 50, True), (2, 6, 6, 3000, 3000, False)]:
    for D in head_dims:
        q, k, v = inputs(B, Hq, Hkv, Tq, Tk, D)
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device="cuda").tril(Tk - Tq) if causal else None
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
        math = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        for tile in triton_hopper.TILES[D]:
            o, lse = outputs(q)
            o.fill_(float("nan"))
            triton_hopper.forward(q, k, v, o, lse, causal, D ** -0.5, tile)
            err, bound = (o.double() - exact).abs().max().item(), 2 * (math.double() - exact).abs().max().item() + 1e-5
            checks.append(dict(shape=(B, Hq, Hkv, Tq, Tk, D, causal), tile=tile, err=err, bound=bound,
                               ok=bool(err <= bound)))
            print(json.dumps(checks[-1]), flush=True)
with open(f"{out_dir}/checks.json", "w") as f:
    json.dump(dict(meta=meta, checks=checks), f, indent=1)
print(f"float64 checks: {sum(c['ok'] for c in checks)} of {len(checks)} passed", file=sys.stderr, flush=True)

CELLS = [(16384 // T, 2048 // D, T, D, causal) for D in head_dims for causal in (False, True)
         for T in (1024, 4096, 16384)] + [(16, 12, 1024, 64, True)] * (64 in head_dims)
rows = []
for B, H, T, D, causal in CELLS:
    q, k, v = inputs(B, H, H, T, T, D)
    o, lse = outputs(q)
    runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    for tile in triton_hopper.TILES[D]:
        launched = triton_hopper.forward(q, k, v, o, lse, causal, D ** -0.5, tile)
        runs[f"rings {tile}"] = lambda launched=launched: launched.again(q, k, v, o, lse, D ** -0.5)
    for tile in base_hopper.TILES[D]:
        launched = base_hopper.forward(q, k, v, o, lse, causal, D ** -0.5, tile)
        runs[f"base {tile}"] = lambda launched=launched: launched.again(q, k, v, o, lse, D ** -0.5)
    times = {name: [] for name in runs}
    names = list(runs)
    for r in range(3):
        for name in names[r * 3 % len(names):] + names[:r * 3 % len(names)]:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                times[name].append(triton.testing.do_bench(runs[name], rep=100, return_mode="median"))
    for name, ts in times.items():
        rows.append(dict(B=B, H=H, T=T, D=D, causal=causal, name=name, ms=statistics.median(ts), rounds_ms=ts,
                         **meta))
    cell = {r["name"]: r["ms"] for r in rows[-len(times):]}
    ratio = {name: cell["cudnn"] / ms for name, ms in cell.items() if name != "cudnn"}
    per_tile = " ".join(f"{tile}:" + (f"{ratio[f'base {base_tile(tile)}']:.3f}" if base_tile(tile) else "new")
                        + f"->{ratio[f'rings {tile}']:.3f}" for tile in triton_hopper.TILES[D])
    best = {name: max(r for n, r in ratio.items() if n.startswith(name)) for name in ("base", "rings")}
    line = (f"B{B} H{H} T{T} hs{D} {'causal' if causal else 'full'} | {per_tile} | "
            f"best {best['base']:.3f} -> {best['rings']:.3f}")
    print(line, file=sys.stderr, flush=True)
    with open(f"{out_dir}/kv_table.txt", "a") as f:
        f.write(line + "\n")
with open(f"{out_dir}/kv.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
