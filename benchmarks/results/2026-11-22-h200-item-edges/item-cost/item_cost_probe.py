"""Probe: what a work item costs the Hopper forward beyond its key tiles, and a stagger between its consumers.
1. Non-causal, 16k tokens, T = 512 ... 8192: a program's items have T / BLOCK_N key tiles each, so a fit of
   time = turns x (a + b x tiles per item) over T separates the per-item cost a from the per-tile cost b (turns: items
   per program). The same fit for cuDNN's forward, as if it ran 128-row items on 132 SMs (its real tiling is not
   known), for comparison.
2. `stagger` (.gpu_carry/triton_hopper_stagger.py: the package's kernel where consumer w > 0 starts its first S only
   once consumer w - 1 has finished its first softmax, so the consumers are out of step from the start, and with two
   Q buffers nothing makes them wait for each other at an item's edge) against the package, tile for tile; float64
   checks first.
3. With VARIANT nostore (.gpu_carry/triton_hopper_nostore.py: the package's kernel with O's normalisation and store
   behind a branch never taken, so the matmuls stay), the same fit: what the epilogue's store costs per item. No
   float64 checks there (it writes no O).
Package tiles: (128, 3, persistent, 2) at both head dims. bf16, do_bench median over three rotating rounds.

The variants are 4578443's attention/triton_hopper.py with this folder's VARIANT.patch:

    git show 4578443:attention/triton_hopper.py | sed 's/^from .launch/from attention.launch/' \
        > .gpu_carry/triton_hopper_VARIANT.py
    patch .gpu_carry/triton_hopper_VARIANT.py benchmarks/results/2026-11-22-h200-item-edges/item-cost/VARIANT.patch
    PYTHONPATH=$PWD python3 benchmarks/results/2026-11-22-h200-item-edges/item-cost/item_cost_probe.py OUT_DIR [VARIANT]
"""
import datetime
import importlib.util
import json
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import triton_flash, triton_hopper

VARIANT = sys.argv[2] if len(sys.argv) > 2 else "stagger"
spec = importlib.util.spec_from_file_location(VARIANT, f".gpu_carry/triton_hopper_{VARIANT}.py")
variant = importlib.util.module_from_spec(spec)
spec.loader.exec_module(variant)
KERNELS = {"package": triton_hopper, VARIANT: variant}
TILE = (128, 3, True, 2)
SMS = torch.cuda.get_device_properties(0).multi_processor_count
out_dir = sys.argv[1]
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

checks = []
for B, H, T, D, causal in [(2, 4, 1000, 64, True), (1, 131, 300, 64, True), (2, 4, 1000, 128, False)] * (
        VARIANT != "nostore"):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    bound = 2 * (F.scaled_dot_product_attention(q, k, v, is_causal=causal).double() - exact).abs().max().item() + 1e-5
    for tile in [TILE, (128, 3, True, 3)] if D == 64 else [TILE]:
        o, lse = torch.full_like(q, float("nan")), torch.empty(B, H, T, device="cuda")
        for _ in range(5):
            variant.forward(q, k, v, o, lse, causal, D ** -0.5, tile)
            err = (o.double() - exact).abs().max().item()
            checks.append(dict(shape=(B, H, T, D, causal), tile=tile, err=err, bound=bound, ok=err <= bound))
print(f"float64 checks: {sum(c['ok'] for c in checks)} of {len(checks)} passed", file=sys.stderr)

CELLS = [(D, T, False) for D in (64, 128) for T in (512, 1024, 2048, 4096, 8192)] + \
        [(D, T, True) for D in (64, 128) for T in (1024, 4096)]
rows = []
for D, T, causal in CELLS:
    B, H = 16384 // T, 2048 // D
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o, lse = triton_flash.empty_bthd(B, H, T, D, q), torch.empty(B, H, T, device="cuda")
    runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    for name, kernel in KERNELS.items():
        runs[name] = lambda kernel=kernel: kernel.forward(q, k, v, o, lse, causal, D ** -0.5, TILE)
    times = {name: [] for name in runs}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
        for fn in runs.values():
            fn()
        names = list(runs)
        for r in range(3):
            for name in names[r:] + names[:r]:
                times[name].append(triton.testing.do_bench(runs[name], rep=100, return_mode="median"))
    items = B * H * triton.cdiv(T, 128)
    for name, ts in times.items():
        rows.append(dict(D=D, T=T, causal=causal, B=B, H=H, who=name, ms=statistics.median(ts), rounds_ms=ts,
                         items=items, turns=items / SMS, tiles_per_item=T / 128, **meta))
        print(json.dumps(rows[-1]), flush=True)
with open(f"{out_dir}/item_cost_{VARIANT}.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
with open(f"{out_dir}/checks.json", "w") as f:
    json.dump(checks, f, indent=1)

lines = [f"float64 checks ({VARIANT}): {sum(c['ok'] for c in checks)} of {len(checks)} passed",
         "fit, non-causal T=512..8192: us per item = a + b x key tiles (us per 128-row item on one SM)"]
for D in (64, 128):
    for who in ("cudnn", *KERNELS):
        pts = [r for r in rows if r["D"] == D and r["who"] == who and not r["causal"]]
        x = np.array([[1.0, r["tiles_per_item"]] for r in pts])
        y = np.array([1e3 * r["ms"] / r["turns"] for r in pts])
        (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
        residual = max(abs(y - x @ np.array([a, b])) / y)
        lines.append(f"hs{D} {who}: a = {a:.2f} us, b = {b:.3f} us per tile (worst residual {100 * residual:.1f}%)")
lines.append(f"cell | cudnn/package | cudnn/{VARIANT}")
for D, T, causal in CELLS:
    ms = {r["who"]: r["ms"] for r in rows if (r["D"], r["T"], r["causal"]) == (D, T, causal)}
    lines.append(f"hs{D} T{T} {'causal' if causal else 'full'} | {ms['cudnn'] / ms['package']:.3f} | "
                 f"{ms['cudnn'] / ms[VARIANT]:.3f}")
with open(f"{out_dir}/item_cost_table_{VARIANT}.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), file=sys.stderr)
