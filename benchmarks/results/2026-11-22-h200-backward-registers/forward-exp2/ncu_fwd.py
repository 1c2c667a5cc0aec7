"""One forward pass, run five times, for Nsight Compute to profile every kernel of the last run:
python3 ncu_fwd.py <ours|cudnn> B H T D causal [BLOCK_N,STAGES,PERSISTENT]"""
import sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from attention import triton_hopper

who = sys.argv[1]
B, H, T, D = (int(x) for x in sys.argv[2:6])
causal = sys.argv[6] == "1"
tile = tuple(int(x) for x in sys.argv[7].split(",")) if len(sys.argv) > 7 else (128, 3, 1)
make = lambda: torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
q, k, v = make(), make(), make()
o = torch.empty_like(q)
lse = torch.empty(B, H, T, device="cuda", dtype=torch.float32)
for run in range(5):
    if run == 4:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    if who == "cudnn":
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        triton_hopper.forward(q, k, v, o, lse, causal, D ** -0.5, (tile[0], tile[1], bool(tile[2])))
torch.cuda.synchronize()
torch.cuda.profiler.stop()
