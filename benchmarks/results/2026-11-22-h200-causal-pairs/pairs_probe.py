"""Probe: the warp-specialized forward's persistent grid walking pairs of work items (a long and a short query
tile under the causal mask, so every program's share has the same length) against the kernel as it was (HEAD's
attention/triton_hopper.py: persistent only without the mask, one item per turn), each (BLOCK_N, STAGES) with and
without the persistent grid, beside cuDNN, on the benchmark grid; hs=128 also with 128-key tiles. Forward only, bf16,
do_bench median; every output checked against cuDNN's.

    git show <before>:attention/triton_hopper.py | sed 's/^from .launch/from attention.launch/' > .gpu_carry/triton_hopper_head.py
    PYTHONPATH=$PWD python3 benchmarks/results/2026-11-22-h200-causal-pairs/pairs_probe.py > $OUT/pairs.jsonl
"""
import importlib.util
import json
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import triton_flash, triton_hopper

spec = importlib.util.spec_from_file_location("head", ".gpu_carry/triton_hopper_head.py")
head = importlib.util.module_from_spec(spec)
spec.loader.exec_module(head)

TILES = {64: [(128, 3), (64, 4), (128, 2)], 128: [(64, 3), (64, 4), (128, 2), (128, 3)]}
CELLS = [(16, 12, 1024, 64, True)] + [(16384 // T, 2048 // D, T, D, causal) for D in (64, 128)
                                      for causal in (True, False) for T in (1024, 4096, 16384)]
rows = []
for B, H, T, D, causal in CELLS:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    o, lse = triton_flash.empty_bthd(B, H, T, D, q), torch.empty(B, H, T, device="cuda")
    for tile in TILES[D]:
        for persistent in (False, True):
            if tile in head.TILES[D] or tuple((*tile, persistent)) in head.TILES[D]:  # HEAD's kernel, same tile
                runs[f"head{tile}{'P' if persistent else ''}"] = (
                    lambda tile=tile, p=persistent: head.forward(q, k, v, o, lse, causal, D ** -0.5, (*tile, p)))
            runs[f"pairs{tile}{'P' if persistent else ''}"] = (
                lambda tile=tile, p=persistent: triton_hopper.forward(q, k, v, o, lse, causal, D ** -0.5, (*tile, p)))
    for name, fn in runs.items():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o.fill_(float("nan"))
            result = fn()
            out = result if name == "cudnn" else o  # the Gluon kernels write o
            diff = (out.float() - ref.float()).abs().max().item()
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        row = dict(B=B, H=H, T=T, D=D, causal=causal, name=name, ms=ms, max_diff_vs_cudnn=diff)
        rows.append(row)
        print(json.dumps(row), flush=True)

# the short table: per cell, cuDNN's time over the best of HEAD's kernel and of the pairs kernel, and the winner
print("cell | cudnn ms | head best | pairs best | pairs winner | max diff", file=sys.stderr)
for B, H, T, D, causal in CELLS:
    cell = [r for r in rows if (r["B"], r["H"], r["T"], r["D"], r["causal"]) == (B, H, T, D, causal)]
    cudnn = next(r["ms"] for r in cell if r["name"] == "cudnn")
    best = {kind: min((r for r in cell if r["name"].startswith(kind)), key=lambda r: r["ms"]) for kind in ("head", "pairs")}
    print(f"B{B} H{H} T{T} hs{D} {'causal' if causal else 'full'} | {cudnn:.4f} | {cudnn / best['head']['ms']:.3f} | "
          f"{cudnn / best['pairs']['ms']:.3f} | {best['pairs']['name']} | {max(r['max_diff_vs_cudnn'] for r in cell):.4f}",
          file=sys.stderr)
