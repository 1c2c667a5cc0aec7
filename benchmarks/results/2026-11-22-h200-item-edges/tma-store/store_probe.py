"""Probe: the Hopper forward storing O by TMA (the package: each consumer's O tile through shared memory, then one
bulk copy) against storing it from registers (`gstore`: .gpu_carry/triton_hopper_gstore.py, 4578443's
attention/triton_hopper.py, 4-byte stores 8 rows apart, 1.4-2.4 us per work item in item-cost/). The staging tiles
take 8 KB (hs=64) or 16 KB (hs=128) per consumer, so at hs=128 BLOCK_N=128 fits 2 stages, not 3. As run, the package
had TILES[128] = [(128, 2, True, 2), (64, 3, True, 2)], every tile staged; the commit after it (2f9fa96) keeps
(128, 3, True, 2) with the register stores instead of (128, 2, True, 2), the faster of the two here. First float64
checks of every package tile on odd shapes, then every forward cell beside cuDNN, each kernel's tiles and the
package's tuner, three rounds in rotating order, do_bench median. bf16.

    git show 4578443:attention/triton_hopper.py | sed 's/^from .launch/from attention.launch/' \
        > .gpu_carry/triton_hopper_gstore.py
    PYTHONPATH=$PWD python3 benchmarks/results/2026-11-22-h200-item-edges/tma-store/store_probe.py OUT_DIR
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

spec = importlib.util.spec_from_file_location("gstore", ".gpu_carry/triton_hopper_gstore.py")
gstore = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gstore)
KERNELS = {"gstore": gstore, "package": triton_hopper}
out_dir = sys.argv[1]
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

# float64 checks: ragged, Tq < Tk and Tq > Tk under the causal mask (rows that see no key), shorter than a tile,
# GQA, more items than SMs
checks = []
for D in (64, 128):
    for B, Hq, Hkv, Tq, Tk, causal in [(2, 4, 4, 1000, 1000, True), (2, 4, 2, 300, 1000, True),
                                       (2, 4, 2, 1000, 300, True), (1, 2, 2, 50, 50, False),
                                       (1, 131, 131, 300, 300, True), (4, 8, 2, 1000, 1000, False)]:
        torch.manual_seed(0)
        q = torch.randn(B, Hq, Tq, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, Tk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kr, vr = (t.repeat_interleave(Hq // Hkv, 1) for t in (k, v))
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device="cuda").tril(Tk - Tq) if causal else None
        exact = F.scaled_dot_product_attention(q.double(), kr.double(), vr.double(), attn_mask=mask)
        math = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
        seen = mask.any(-1)[None, None, :, None] if causal else torch.ones(1, dtype=torch.bool, device="cuda")
        exact, math = exact.nan_to_num(0.0) * seen, math.nan_to_num(0.0) * seen  # rows that see no key: O = 0
        bound = 2 * (math.double() - exact).abs().max().item() + 1e-5
        for tile in triton_hopper.TILES[D]:
            o = triton_flash.empty_bthd(B, Hq, Tq, D, q).fill_(float("nan"))
            lse = torch.empty(B, Hq, Tq, device="cuda")
            for _ in range(5):
                triton_hopper.forward(q, k, v, o, lse, causal, D ** -0.5, tile)
            err = (o.double() - exact).abs().max().item()
            checks.append(dict(shape=(B, Hq, Hkv, Tq, Tk, D, causal), tile=tile, err=err, bound=bound,
                               ok=err <= bound))
            print(json.dumps(checks[-1]), flush=True)
with open(f"{out_dir}/checks.json", "w") as f:
    json.dump(checks, f, indent=1)

CELLS = [(16, 12, 1024, 64, True)] + [(16384 // T, 2048 // D, T, D, causal) for D in (64, 128)
                                      for causal in (True, False) for T in (1024, 4096, 16384)]
rows = []
for B, H, T, D, causal in CELLS:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o, lse = triton_flash.empty_bthd(B, H, T, D, q), torch.empty(B, H, T, device="cuda")
    runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    for name, kernel in KERNELS.items():
        for tile in kernel.TILES[D]:
            runs[f"{name}{tile}"] = lambda kernel=kernel, tile=tile: kernel.forward(q, k, v, o, lse, causal,
                                                                                    D ** -0.5, tile)
    runs["tuner"] = lambda: attention(q, k, v, causal=causal, backend="triton")
    times = {name: [] for name in runs}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
        for fn in runs.values():
            fn()
        names = list(runs)
        for r in range(3):
            for name in names[r * 3 % len(names):] + names[:r * 3 % len(names)]:
                times[name].append(triton.testing.do_bench(runs[name], rep=100, return_mode="median"))
    tuned = str(triton_flash.tuned_choices(D, causal, torch.bfloat16, T, T).get("fwd"))
    for name, ts in times.items():
        rows.append(dict(B=B, H=H, T=T, D=D, causal=causal, name=name, ms=statistics.median(ts), rounds_ms=ts,
                         tuner_choice=tuned, **meta))
        print(json.dumps(rows[-1]), flush=True)
with open(f"{out_dir}/store.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)

lines = [f"float64 checks: {sum(c['ok'] for c in checks)} of {len(checks)} passed",
         "cell | gstore best (tile) | package best (tile) | tuner (choice); cuDNN's time / ours"]
for B, H, T, D, causal in CELLS:
    cell = {r["name"]: r for r in rows if (r["B"], r["H"], r["T"], r["D"], r["causal"]) == (B, H, T, D, causal)}
    cudnn = cell["cudnn"]["ms"]
    best = {k: min((r for n, r in cell.items() if n.startswith(k)), key=lambda r: r["ms"]) for k in KERNELS}
    lines.append(f"B{B} H{H} T{T} hs{D} {'causal' if causal else 'full'} | "
                 + " | ".join(f"{cudnn / best[k]['ms']:.3f} {best[k]['name'][len(k):]}" for k in KERNELS)
                 + f" | {cudnn / cell['tuner']['ms']:.3f} {cell['tuner']['tuner_choice']}")
with open(f"{out_dir}/store_table.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), file=sys.stderr)
