"""What a package's tuner chooses for each cell of tuner_audit.py, forward and backward, in a process of its own.
Run with HEAD's package first on the path (the tuner as it was), so tuner_audit.py can time HEAD's choices under load:

    PYTHONPATH=.gpu_carry/before:$PWD python3 -P benchmarks/results/2026-11-22-h200-tuner-under-load/head_choices.py OUT.json
"""
import json
import sys

import torch

import attention as package
from attention import attention, triton_flash

sys.path.insert(0, "benchmarks/results/2026-11-22-h200-tuner-under-load")
from tuner_cells import CELLS  # noqa: E402

choices = {"package": package.__file__}
for B, H, T, D, causal in CELLS:
    for table in (triton_flash._best_tile, triton_flash._best_backward, triton_flash._plans):
        table.clear()
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch.autograd.grad(attention(q, k, v, causal=causal, backend="triton"), (q, k, v), torch.randn_like(q))
    fwd = [choice for key, choice in triton_flash._best_tile.items() if key[0] == "fwd"]
    choices[str((B, H, T, D, causal))] = {"fwd": str(fwd[0]), "bwd": str(next(iter(triton_flash._best_backward.values())))}
    print(B, H, T, D, causal, choices[str((B, H, T, D, causal))], flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(choices, f, indent=1)
