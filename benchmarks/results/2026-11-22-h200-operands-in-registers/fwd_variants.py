"""Timing probe: variants of the Gluon forward (.gpu_carry/hfv_<name>.py, copies of attention/triton_hopper.py with
one change each) side by side with the package's forward (its tuner choosing), its `tl` forward alone and cuDNN.

    PYTHONPATH=. python3 benchmarks/results/2026-11-22-h200-operands-in-registers/fwd_variants.py base,qreg [64,128]

Each variant runs every tile of its TILES (and BLOCK_N=128 at hs=128, which the package does not offer), persistent
tiles without the causal mask only. Sanity: the largest difference from the `tl` output (the float64 checks are the
GPU tests'). Writes $OUT/fwd_variants.json; prints cuDNN time / time per column."""
import importlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, ".gpu_carry")
from attention import triton_flash  # noqa: E402

OUT = os.environ.get("OUT", "out")
variants = {name: importlib.import_module("hfv_" + name) for name in sys.argv[1].split(",")}
SHAPES = [(16, 12, 1024, 64, True), (16, 32, 1024, 64, True), (4, 32, 4096, 64, True), (1, 32, 16384, 64, True),
          (16, 32, 1024, 64, False), (4, 32, 4096, 64, False), (1, 32, 16384, 64, False),
          (16, 16, 1024, 128, True), (4, 16, 4096, 128, True), (1, 16, 16384, 128, True),
          (16, 16, 1024, 128, False), (4, 16, 4096, 128, False), (1, 16, 16384, 128, False)]
if len(sys.argv) > 2:  # only these head dims
    SHAPES = [shape for shape in SHAPES if str(shape[3]) in sys.argv[2].split(",")]
EXTRA = {128: [(128, 2, False), (128, 2, True)]} if os.environ.get("FWD_EXTRA", "1") == "1" else {}


def bench(fn):
    fn()  # tuning and compilation outside the timed runs (do_bench sizes its runs from the first ones)
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
start = time.time()
while time.time() - start < 2:  # the GPU clocks up before the first cell
    x @ x
rows = []
for B, H, T, D, causal in SHAPES:
    make = lambda: torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    q, k, v = make(), make(), make()
    scale = D ** -0.5
    row = dict(B=B, H=H, T=T, D=D, causal=causal)
    triton_flash.HOPPER_MODE = "0"
    reference, _ = triton_flash.forward(q, k, v, causal, scale)
    row["tl"] = bench(lambda: triton_flash.forward(q, k, v, causal, scale))
    triton_flash.HOPPER_MODE = "auto"
    row["package"] = bench(lambda: triton_flash.forward(q, k, v, causal, scale))
    o, lse = torch.empty_like(reference), torch.empty(B, H, T, device="cuda")
    for name, mod in variants.items():
        for tile in mod.tiles(D, causal) + [t for t in EXTRA.get(D, []) if not (causal and t[2])]:
            label = f"{name}_{tile[0]}_{tile[1]}{'p' if tile[2] else ''}"
            try:
                o.fill_(float("nan"))
                mod.forward(q, k, v, o, lse, causal, scale, tile)
                row[label + "_err"] = (o.float() - reference.float()).abs().max().item()
                row[label] = bench(lambda: mod.forward(q, k, v, o, lse, causal, scale, tile))
            except Exception as e:  # a tile that does not fit: recorded, the sweep goes on
                row[label] = repr(e)[:200]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        row["cudnn"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=rows),
          open(os.path.join(OUT, "fwd_variants.json"), "w"), indent=1)
for r in rows:
    times = {k: v for k, v in r.items() if isinstance(v, float) and not k.endswith("_err") and k != "cudnn"}
    best = max(times, key=lambda k: r["cudnn"] / times[k])
    print((r["B"], r["H"], r["T"], r["D"], r["causal"]), f"best={best}",
          " ".join(f"{k}={r['cudnn'] / v:.2f}" for k, v in times.items()))
