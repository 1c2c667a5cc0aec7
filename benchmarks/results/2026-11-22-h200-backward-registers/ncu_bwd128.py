"""One backward pass (hs=128, B=4, H=16, T=4096, non-causal, bf16), run five times, for Nsight Compute to profile
every kernel of the last run: python3 ncu_bwd128.py <committed|offset|cudnn> [D]"""
import os, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, os.path.dirname(__file__))
from attention import triton_flash
import hbv_committed, hbv_offset, hbv_offset1, hbv_staging1

who = sys.argv[1]
D = int(sys.argv[2]) if len(sys.argv) > 2 else 128
B, H, T, causal = 4, 2048 // D, 4096, False
make = lambda: torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
q, k, v, do = make(), make(), make(), make()
scale = D ** -0.5
o, lse = triton_flash.forward(q, k, v, causal, scale)
for run in range(5):
    if run == 4:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    if who == "cudnn":
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
            torch.autograd.grad(out, (qq, kk, vv), do)
    else:
        grads = [torch.empty_like(t) for t in (q, k, v)]
        dict(committed=hbv_committed, offset=hbv_offset, offset1=hbv_offset1, staging1=hbv_staging1)[who].backward(do, q, k, v, o, lse, *grads, causal, scale, 2)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
