"""Probe: does the grid time our forward slower because it times it right after tuning? benchmarks/attention.py times
each cell after one warm-up call, and our first call of a shape tunes (about a second of candidates back to back,
§9), so our do_bench runs on a GPU that has just been under load, where cuDNN's follows the cell before. At hs=128 T=4k
the grids measured 0.84-0.92x where probes that time in rotating rounds measured 0.94-1.05x. Here, per cell: cuDNN,
our first call (the tuner), ours at once, then cuDNN and ours again and again (do_bench, 100 ms each, as the grid), and
ours after 2 s idle. bf16, forward with autograd on, as the grid.

    PYTHONPATH=$PWD python3 benchmarks/results/2026-11-22-h200-item-edges/heat/heat_probe.py OUT_DIR
"""
import datetime
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import attention

out_dir = sys.argv[1]
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
rows, lines = [], ["cell: sequence of (who, ms) in the order timed; cudnn / ours after tuning, then later"]
for B, H, T, D, causal in [(4, 16, 4096, 128, True), (4, 16, 4096, 128, False), (16, 32, 1024, 64, False)]:
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def ours():
        return attention(q, k, v, causal=causal, backend="triton")

    def bench(fn):
        return triton.testing.do_bench(fn, rep=100, return_mode="median")

    cudnn()
    sequence = [("cudnn", bench(cudnn))]
    ours()  # tunes
    sequence += [("ours after tuning", bench(ours)), ("cudnn", bench(cudnn)), ("ours", bench(ours)),
                 ("cudnn", bench(cudnn)), ("ours", bench(ours))]
    torch.cuda.synchronize()
    time.sleep(2)
    sequence.append(("ours after 2 s idle", bench(ours)))
    rows.append(dict(B=B, H=H, T=T, D=D, causal=causal, sequence=sequence, **meta))
    c = sequence[0][1]
    lines.append(f"B{B} H{H} T{T} hs{D} {'causal' if causal else 'full'}: "
                 + ", ".join(f"{who} {ms:.4f}" for who, ms in sequence)
                 + f" | cudnn/ours: after tuning {c / sequence[1][1]:.3f}, later {sequence[4][1] / sequence[5][1]:.3f}")
with open(f"{out_dir}/heat.json", "w") as f:
    json.dump(rows, f, indent=1)
with open(f"{out_dir}/heat_table.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), file=sys.stderr)
