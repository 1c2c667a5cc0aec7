"""Probe: what the last turn of a persistent grid costs. The Hopper forward's persistent programs walk pairs of
work items, one program per SM (132 on the H200). In the grid's cells the pair count is not a multiple of 132
(hs=64: 2048 pairs, 15.5 per program; hs=128: 1024, 7.76), so the last turn leaves SMs idle: ~3% if the work were
even. Each cell is timed beside a twin with slightly more heads, whose pair count is a whole number of turns
(hs=64: 33 heads instead of 32; hs=128: 264 or 66 (batch, head)s instead of 256 or 64), ours (the package, the tuner
choosing) and cuDNN's, three rounds in rotating order, do_bench median. Time per (batch, head): if the last turn
costs what the arithmetic says, ours drops by ~3% in the twin and cuDNN's does not. bf16.

    PYTHONPATH=$PWD python3 benchmarks/results/2026-11-22-h200-item-edges/tail/tail_probe.py OUT_DIR
"""
import datetime
import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import attention, triton_flash

out_dir = sys.argv[1]
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
# (hs, T, causal): (B, H) of the grid's cell, (B, H) of its twin
PAIRS = {(64, 1024, True): ((16, 32), (16, 33)), (64, 1024, False): ((16, 32), (16, 33)),
         (64, 4096, True): ((4, 32), (4, 33)), (128, 1024, True): ((16, 16), (11, 24)),
         (128, 1024, False): ((16, 16), (11, 24)), (128, 4096, True): ((4, 16), (3, 22)),
         (128, 4096, False): ((4, 16), (3, 22))}
rows = []
for (D, T, causal), shapes in PAIRS.items():
    runs = {}
    tensors = []
    for B, H in shapes:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        tensors.append((q, k, v))
        runs[("cudnn", B, H)] = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        runs[("ours", B, H)] = lambda q=q, k=k, v=v: attention(q, k, v, causal=causal, backend="triton")
    times = {name: [] for name in runs}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
        for fn in runs.values():
            fn()  # tune, compile
        names = list(runs)
        for r in range(3):
            for name in names[r:] + names[:r]:
                times[name].append(triton.testing.do_bench(runs[name], rep=100, return_mode="median"))
    choice = str(triton_flash.tuned_choices(D, causal, torch.bfloat16, T, T).get("fwd"))
    for (who, B, H), ts in times.items():
        rows.append(dict(D=D, T=T, causal=causal, who=who, B=B, H=H, ms=statistics.median(ts), rounds_ms=ts,
                         ms_per_head=statistics.median(ts) / (B * H), tuner_choice=choice, **meta))
        print(json.dumps(rows[-1]), flush=True)
with open(f"{out_dir}/tail.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)

lines = ["cell (B x H -> twin) | ours: time per head, twin / cell | cudnn: the same | ratio cudnn/ours cell -> twin"]
for (D, T, causal), (cell, twin) in PAIRS.items():
    get = {(r["who"], r["B"], r["H"]): r["ms_per_head"] for r in rows if (r["D"], r["T"], r["causal"]) == (D, T, causal)}
    ours, cudnn = (get[("ours", *twin)] / get[("ours", *cell)]), (get[("cudnn", *twin)] / get[("cudnn", *cell)])
    lines.append(f"hs{D} T{T} {'causal' if causal else 'full'} ({cell[0]}x{cell[1]} -> {twin[0]}x{twin[1]}) | "
                 f"{ours:.3f} | {cudnn:.3f} | {get[('cudnn', *cell)] / get[('ours', *cell)]:.3f} -> "
                 f"{get[('cudnn', *twin)] / get[('ours', *twin)]:.3f}")
with open(f"{out_dir}/tail_table.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), file=sys.stderr)
