"""One attention pass, run five times, for Nsight Compute to profile every kernel of the last run:

    ncu --clock-control none --profile-from-start off --section ... \
        python3 ncu_probe.py <ours|cudnn> <fwd|bwd> B H T D causal

ours fwd: the Gluon forward (triton_hopper; tile BLOCK_N,STAGES,PERSISTENT from NCU_TILE, default 64,3,0);
ours bwd: the Gluon backward (2 stages); cudnn: PyTorch's cuDNN attention, the same pass."""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import triton_flash, triton_hopper, triton_hopper_backward

who, which = sys.argv[1], sys.argv[2]
B, H, T, D = (int(x) for x in sys.argv[3:7])
causal = sys.argv[7] == "1"
make = lambda: torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
q, k, v, do = make(), make(), make(), make()
scale = D ** -0.5
triton_flash.HOPPER_MODE = "0"
o, lse = triton_flash.forward(q, k, v, causal, scale)
tile = tuple(int(x) for x in os.environ.get("NCU_TILE", "64,3,0").split(","))
for run in range(5):
    if run == 4:  # ncu --profile-from-start off: every kernel of the last pass
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    if who == "ours" and which == "fwd":
        triton_hopper.forward(q, k, v, o, lse, causal, scale, (tile[0], tile[1], bool(tile[2])))
    elif who == "ours":
        grads = [torch.empty_like(t) for t in (q, k, v)]
        triton_hopper_backward.backward(do, q, k, v, o, lse, *grads, causal, scale, 2)
    else:
        qq, kk, vv = (t.detach().requires_grad_(which == "bwd") for t in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
            if which == "bwd":
                torch.autograd.grad(out, (qq, kk, vv), do)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
