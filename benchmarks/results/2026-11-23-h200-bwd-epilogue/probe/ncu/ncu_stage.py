"""One Hopper backward (hs=64, B=1, H=32, T=16384, non-causal, bf16) with tile (3, STAGED), run three times, for
Nsight Compute to profile the last main kernel: python3 .gpu_carry/ncu_stage.py <0|1> [T] [causal 0|1]"""
import sys
import torch
from attention import triton_flash, triton_hopper_backward

staged = sys.argv[1] == "1"
T = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
causal = len(sys.argv) > 3 and sys.argv[3] == "1"
D, H = 64, 32
B = 16384 // T
make = lambda: torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)  # noqa: E731
q, k, v, do = make(), make(), make(), make()
o, lse = triton_flash.forward(q, k, v, causal, D ** -0.5)
grads = [torch.empty_like(t) for t in (q, k, v)]
launched = triton_hopper_backward.backward(do, q, k, v, o, lse, *grads, causal, D ** -0.5, (3, staged))
for run in range(3):
    if run == 2:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    launched.again(do, q, k, v, o, lse, *grads, D ** -0.5)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
