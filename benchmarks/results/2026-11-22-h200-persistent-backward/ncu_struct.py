"""For Nsight Compute: the committed backward (hbv_grouped) or the item-loop one in the same program order
(hbv_pgrouped, a program per item), one pass profiled after warm-ups. python3 ncu_struct.py old|new B H T D causal"""
import os, sys
import torch
sys.path.insert(0, os.path.dirname(__file__))
from attention import triton_flash
import hbv_grouped, hbv_pgrouped

which = sys.argv[1]
B, H, T, D = (int(x) for x in sys.argv[2:6])
causal = sys.argv[6] == "1"
make = lambda: torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
q, k, v, do = make(), make(), make(), make()
scale = D ** -0.5
o, lse = triton_flash.forward(q, k, v, causal, scale)
grads = [torch.empty_like(t) for t in (q, k, v)]
for run in range(5):
    if run == 4:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    if which == "old":
        hbv_grouped.backward(do, q, k, v, o, lse, *grads, causal, scale, 2)
    else:
        hbv_pgrouped.backward(do, q, k, v, o, lse, *grads, causal, scale, (2, False))
torch.cuda.synchronize()
torch.cuda.profiler.stop()
