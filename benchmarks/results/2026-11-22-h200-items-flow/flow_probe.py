"""Probe: the warp-specialized forward whose consumers walk their key tiles over all their items as one sequence
(the next item's first S issued with this item's last P V) against the kernel as it was (HEAD's
attention/triton_hopper.py: each item started and ended on its own), tile for tile, beside cuDNN, on the benchmark
grid and GPT-2's cell; also the package's forward with its tuner choosing (and what it chose). Forward only, bf16,
do_bench median over rounds in rotating order; every output checked against cuDNN's.

    git show HEAD:attention/triton_hopper.py | sed 's/^from .launch/from attention.launch/' > .gpu_carry/triton_hopper_head.py
    PYTHONPATH=$PWD python3 benchmarks/results/2026-11-22-h200-items-flow/flow_probe.py OUT_DIR
"""
import datetime
import importlib.util
import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import attention, triton_flash, triton_hopper

spec = importlib.util.spec_from_file_location("head", ".gpu_carry/triton_hopper_head.py")
head = importlib.util.module_from_spec(spec)
spec.loader.exec_module(head)

out_dir = sys.argv[1]
ROUNDS = 3
CELLS = [(16, 12, 1024, 64, True)] + [(16384 // T, 2048 // D, T, D, causal) for D in (64, 128)
                                      for causal in (True, False) for T in (1024, 4096, 16384)]
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
triton_flash.tuning_log = []
rows = []
for B, H, T, D, causal in CELLS:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o, lse = triton_flash.empty_bthd(B, H, T, D, q), torch.empty(B, H, T, device="cuda")
    runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    for tile in triton_hopper.TILES[D]:
        runs[f"head{tile}"] = lambda tile=tile: head.forward(q, k, v, o, lse, causal, D ** -0.5, tile)
        runs[f"flow{tile}"] = lambda tile=tile: triton_hopper.forward(q, k, v, o, lse, causal, D ** -0.5, tile)
    with torch.no_grad():
        runs["package"] = lambda: attention(q, k, v, causal=causal, backend="triton")
    times = {name: [] for name in runs}
    diffs = {}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
        for name, fn in runs.items():  # first calls: compile, tune, check
            o.fill_(float("nan"))
            result = fn()
            out = result if name in ("cudnn", "package") else o  # the Gluon kernels write o
            diffs[name] = (out.float() - ref.float()).abs().max().item()
        names = list(runs)
        for r in range(ROUNDS):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(triton.testing.do_bench(runs[name], warmup=25, rep=100, return_mode="median"))
    for name in runs:
        row = dict(B=B, H=H, T=T, D=D, causal=causal, name=name, ms=statistics.median(times[name]),
                   rounds_ms=times[name], max_diff_vs_cudnn=diffs[name], **meta)
        rows.append(row)
        print(json.dumps(row), flush=True)

with open(f"{out_dir}/flow.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
with open(f"{out_dir}/tuning_log.json", "w") as f:
    json.dump([{**entry, "times_ms": {str(k): v for k, v in entry["times_ms"].items()}}
               for entry in triton_flash.tuning_log], f, indent=1, default=str)

# the short table: per cell cuDNN's time over each kernel's best tile, the same tile head -> flow, the package
lines = ["cell | cudnn ms | head best | flow best (tile) | flow/head same tile | package (tuner) | max diff"]
for B, H, T, D, causal in CELLS:
    cell = {r["name"]: r for r in rows if (r["B"], r["H"], r["T"], r["D"], r["causal"]) == (B, H, T, D, causal)}
    cudnn = cell["cudnn"]["ms"]
    best = {kind: min((r for n, r in cell.items() if n.startswith(kind)), key=lambda r: r["ms"]) for kind in ("head", "flow")}
    same = " ".join(f"{cell['head' + str(t)]['ms'] / cell['flow' + str(t)]['ms']:.3f}" for t in triton_hopper.TILES[D])
    lines.append(f"B{B} H{H} T{T} hs{D} {'causal' if causal else 'full'} | {cudnn:.4f} | {cudnn / best['head']['ms']:.3f}"
                 f" | {cudnn / best['flow']['ms']:.3f} {best['flow']['name'][4:]} | {same} | "
                 f"{cudnn / cell['package']['ms']:.3f} | {max(r['max_diff_vs_cudnn'] for r in cell.values()):.4f}")
with open(f"{out_dir}/flow_table.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), file=sys.stderr)
