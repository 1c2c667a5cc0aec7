"""Probe: every tile of the Hopper backward (attention/triton_hopper_backward.py TILES, with a variant's tiles
added) beside cuDNN's backward, per grid cell. First float64 checks of the tiles not in COMMITTED (more work items
than SMs, GQA, Tq != Tk), then per cell the main kernel's three launches of each tile and cuDNN's backward in three
rounds, the order rotating, do_bench median (100 ms). bf16.

    COMMITTED="[(2, False), ...]" PYTHONPATH=$PWD python3 .../probe/bwd_tiles_probe.py OUT_DIR [64|128]

COMMITTED (a Python list of tiles, default: every tile) is what the table's "best" compares against. `probe64/`
ran this file's first version (git history), which checked and split the tiles by their PERSISTENT flag.
"""
import ast
import os
import datetime
import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import triton_flash, triton_hopper_backward

out_dir = sys.argv[1]
head_dims = [int(sys.argv[2])] if len(sys.argv) > 2 else [64, 128]
committed = set(ast.literal_eval(os.environ["COMMITTED"])) if "COMMITTED" in os.environ else None
new_tiles = {D: [t for t in triton_hopper_backward.TILES[D] if committed is not None and t not in committed]
             for D in head_dims}
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def setup(B, Hq, Hkv, Tq, Tk, D, causal):
    torch.manual_seed(0)
    q = torch.randn(B, Hq, Tq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, Tk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    o, lse = triton_flash.forward(q, k, v, causal, D ** -0.5)
    return q, k, v, do, o, lse


checks = []
for B, Hq, Hkv, Tq, Tk, causal in [(3, 22, 11, 1100, 1100, True), (3, 22, 11, 1100, 1100, False),
                                   (2, 4, 2, 300, 1000, True), (2, 4, 2, 1000, 300, True)]:
    for D in head_dims:
        q, k, v, do, o, lse = setup(B, Hq, Hkv, Tq, Tk, D, causal)
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device="cuda").tril(Tk - Tq) if causal else None
        rep = lambda t: t.repeat_interleave(Hq // Hkv, 1)  # noqa: E731
        exact = torch.autograd.grad(F.scaled_dot_product_attention(qd, rep(kd), rep(vd), attn_mask=mask),
                                    (qd, kd, vd), do.double())
        qm, km, vm = (t.clone().requires_grad_() for t in (q, k, v))
        math = torch.autograd.grad(F.scaled_dot_product_attention(qm, rep(km), rep(vm), attn_mask=mask),
                                   (qm, km, vm), do)
        del qd, kd, vd
        for tile in new_tiles[D]:
            grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
            triton_hopper_backward.backward(do, q, k, v, o, lse, *grads, causal, D ** -0.5, tile)
            for name, ours, ex, m in zip(("dq", "dk", "dv"), grads, exact, math):
                err, bound = (ours.double() - ex).abs().max().item(), 2 * (m.double() - ex).abs().max().item() + 1e-5
                checks.append(dict(shape=(B, Hq, Hkv, Tq, Tk, D, causal), tile=tile, grad=name, err=err, bound=bound,
                                   ok=err <= bound))
                print(json.dumps(checks[-1]), flush=True)
        del exact, math
with open(f"{out_dir}/checks.json", "w") as f:
    json.dump(checks, f, indent=1)

CELLS = [(16, 12, 1024, 64, True)] + [(16384 // T, 2048 // D, T, D, causal) for D in (64, 128)
                                      for causal in (True, False) for T in (1024, 4096, 16384)]
CELLS = [cell for cell in CELLS if cell[3] in head_dims]
rows = []
for B, H, T, D, causal in CELLS:
    q, k, v, do, o, lse = setup(B, H, H, T, T, D, causal)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=causal)
    runs = {"cudnn": lambda: torch.autograd.grad(out, (qc, kc, vc), do, retain_graph=True)}
    for tile in triton_hopper_backward.TILES[D]:
        launched = triton_hopper_backward.backward(do, q, k, v, o, lse, *grads, causal, D ** -0.5, tile)
        runs[str(tile)] = lambda launched=launched: launched.again(do, q, k, v, o, lse, *grads, D ** -0.5)
    times = {name: [] for name in runs}
    names = list(runs)
    for r in range(3):
        for name in names[r * 2 % len(names):] + names[:r * 2 % len(names)]:
            times[name].append(triton.testing.do_bench(runs[name], rep=100, return_mode="median"))
    for name, ts in times.items():
        rows.append(dict(B=B, H=H, T=T, D=D, causal=causal, name=name, ms=statistics.median(ts), rounds_ms=ts, **meta))
        print(json.dumps(rows[-1]), flush=True)
with open(f"{out_dir}/bwd_tiles.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)

lines = [f"float64 checks (tiles not committed): {sum(c['ok'] for c in checks)} of {len(checks)} passed",
         "cuDNN's backward time / ours, per tile; best of the committed tiles -> best of all"]
for B, H, T, D, causal in CELLS:
    cell = {r["name"]: r["ms"] for r in rows if (r["B"], r["H"], r["T"], r["D"], r["causal"]) == (B, H, T, D, causal)}
    ratios = {name: cell["cudnn"] / ms for name, ms in cell.items() if name != "cudnn"}
    best = [max(r for name, r in ratios.items() if committed is None or ast.literal_eval(name) in committed),
            max(ratios.values())]
    lines.append(f"B{B} H{H} T{T} hs{D} {'causal' if causal else 'full'} | "
                 + " ".join(f"{name}:{r:.3f}" for name, r in ratios.items())
                 + f" | best {best[0]:.3f} -> {best[1]:.3f}")
with open(f"{out_dir}/bwd_tiles_table.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), file=sys.stderr)
