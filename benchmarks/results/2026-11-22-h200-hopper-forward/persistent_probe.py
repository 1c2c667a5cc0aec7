"""Probe: the warp-specialized forward with a program per 128-row tile (commit ec2a96f's
attention/triton_hopper.py) against the work-item kernel of the package's attention/triton_hopper.py launched
persistent where the mask is not causal (a program per tile under it), beside cuDNN and the `tl` forward, on the
benchmark grid. Forward only, bf16, do_bench median; every output checked against cuDNN's.

    git show ec2a96f:attention/triton_hopper.py > .gpu_carry/triton_hopper_per_tile.py
    PYTHONPATH=$PWD python3 benchmarks/results/2026-11-22-h200-hopper-forward/persistent_probe.py > $OUT/persistent.jsonl
"""
import importlib.util
import json

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import triton_flash, triton_hopper

spec = importlib.util.spec_from_file_location("per_tile", ".gpu_carry/triton_hopper_per_tile.py")
per_tile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(per_tile)

CELLS = [(16, 12, 1024, 64, True)] + [(16384 // T, 2048 // D, T, D, causal) for D in (64, 128) for causal in (True, False)
                                      for T in (1024, 4096, 16384)]
for B, H, T, D, causal in CELLS:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    triton_flash.HOPPER_MODE = "0"
    runs["tl"] = lambda: triton_flash.forward(q, k, v, causal, D ** -0.5)
    o, lse = triton_flash.empty_bthd(B, H, T, D, q), torch.empty(B, H, T, device="cuda")
    for tile in per_tile.TILES[D]:  # (BLOCK_N, STAGES)
        runs[f"per_tile{tile}"] = lambda tile=tile: per_tile.forward(q, k, v, o, lse, causal, D ** -0.5, tile)
        runs[f"persistent{tile}"] = lambda tile=tile: triton_hopper.forward(q, k, v, o, lse, causal, D ** -0.5,
                                                                            (*tile, not causal))
    for name, fn in runs.items():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            result = fn()
            out = result if name == "cudnn" else result[0] if name == "tl" else o  # the Gluon kernels write o
            diff = (out.float() - ref.float()).abs().max().item()
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        print(json.dumps(dict(B=B, H=H, T=T, D=D, causal=causal, name=name, ms=ms, max_diff_vs_cudnn=diff)), flush=True)
