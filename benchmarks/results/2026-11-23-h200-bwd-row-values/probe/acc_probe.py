"""Probe: the Hopper backward's S^T and dP^T wgmmas starting from -lse / scale and -Delta instead of zero (§13 "Row
values in the accumulators"), so that the (M,) row values need no registers over the exp2s and dS. HEAD's kernel
(carried as .gpu_carry/base/attention_base, a copy of `git archive HEAD attention`) beside the working tree's: float64
checks of the working tree's every tile (dq, dk, dv within 2x math attention's error + 1e-5), then each kernel's three
launches per cell beside cuDNN's backward, three rotating rounds, do_bench median. bf16.

    PYTHONPATH=$PWD:$PWD/.gpu_carry/base python3 benchmarks/results/2026-11-23-h200-bwd-row-values/probe/acc_probe.py \
        OUT_DIR HEAD_DIM [VARIANT ...]

A VARIANT is timed beside them, not checked: .gpu_carry/triton_hopper_backward_VARIANT.py, a copy of the module with
absolute imports. Run 1: the working tree had both row values in the accumulators. Run 2: the working tree has only
Delta there (S^T from zero, lse subtracted after it), `both` is run 1's. Run 3 (hs=128): the kept kernel beside `both`.
Run 4 (hs=128): `s3`, the kept kernel with three ring slots offered at hs=128 too ((3, False), (3, True)).
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

from attention import triton_flash, triton_hopper_backward
from attention_base import triton_hopper_backward as base_backward

out_dir, D = sys.argv[1], int(sys.argv[2])


def load(name):
    spec = importlib.util.spec_from_file_location(name, f".gpu_carry/triton_hopper_backward_{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KERNELS = {"base": base_backward, "package": triton_hopper_backward} | {name: load(name) for name in sys.argv[3:]}
CHECKED = ["package"]
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
for B, Hq, Hkv, Tq, Tk, D, causal in [(2, 4, 4, 1000, 1000, D, True), (2, 4, 2, 300, 1000, D, True),
                                      (1, 4, 1, 777, 777, D, False), (2, 8, 2, 1000, 1000, D, False),
                                      (1, 3, 3, 1100, 1300, D, True)]:
    q, k, v, do, o, lse = setup(B, Hq, Hkv, Tq, Tk, D, causal)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    mask = torch.ones(Tq, Tk, dtype=torch.bool, device="cuda").tril(Tk - Tq) if causal else None
    exact = torch.autograd.grad(F.scaled_dot_product_attention(qd, kd.repeat_interleave(Hq // Hkv, 1),
                                                               vd.repeat_interleave(Hq // Hkv, 1), attn_mask=mask),
                                (qd, kd, vd), do.double())
    qm, km, vm = (t.clone().requires_grad_() for t in (q, k, v))
    math = torch.autograd.grad(F.scaled_dot_product_attention(qm, km.repeat_interleave(Hq // Hkv, 1),
                                                              vm.repeat_interleave(Hq // Hkv, 1), attn_mask=mask),
                               (qm, km, vm), do)
    for variant, tile in [(name, tile) for name in CHECKED for tile in KERNELS[name].TILES[D]]:
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        KERNELS[variant].backward(do, q, k, v, o, lse, *grads, causal, D ** -0.5, tile)
        for name, ours, ex, m in zip(("dq", "dk", "dv"), grads, exact, math):
            err, bound = (ours.double() - ex).abs().max().item(), 2 * (m.double() - ex).abs().max().item() + 1e-5
            checks.append(dict(variant=variant, shape=(B, Hq, Hkv, Tq, Tk, D, causal), tile=tile, grad=name, err=err, bound=bound,
                               ok=err <= bound))
            print(json.dumps(checks[-1]), flush=True)
with open(f"{out_dir}/checks.json", "w") as f:
    json.dump(checks, f, indent=1)

CELLS = [(16, 12, 1024, 64, True)] * (D == 64) + [(16384 // T, 2048 // D, T, D, causal) for causal in (True, False)
                                                   for T in (1024, 4096, 16384)]
rows = []
for B, H, T, D, causal in CELLS:
    q, k, v, do, o, lse = setup(B, H, H, T, T, D, causal)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=causal)
    runs = {"cudnn": lambda: torch.autograd.grad(out, (qc, kc, vc), do, retain_graph=True)}
    for name, kernel in KERNELS.items():
        for tile in kernel.TILES[D]:
            launched = kernel.backward(do, q, k, v, o, lse, *grads, causal, D ** -0.5, tile)
            runs[f"{name}{tile}"] = lambda launched=launched: launched.again(do, q, k, v, o, lse, *grads, D ** -0.5)
    times = {name: [] for name in runs}
    names = list(runs)
    for r in range(3):
        for name in names[r * 2 % len(names):] + names[:r * 2 % len(names)]:
            times[name].append(triton.testing.do_bench(runs[name], rep=100, return_mode="median"))
    for name, ts in times.items():
        rows.append(dict(B=B, H=H, T=T, D=D, causal=causal, name=name, ms=statistics.median(ts), rounds_ms=ts, **meta))
        print(json.dumps(rows[-1]), flush=True)
with open(f"{out_dir}/acc.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)

lines = ["float64 checks (" + ", ".join(CHECKED) + f"): {sum(c['ok'] for c in checks)} of {len(checks)} passed",
         "cell | " + " | ".join(f"{name}{tile}" for name, k in KERNELS.items() for tile in k.TILES[D])
         + " | best " + " | best ".join(KERNELS) + " (cuDNN's backward time / ours)"]
for B, H, T, D, causal in CELLS:
    cell = {r["name"]: r["ms"] for r in rows if (r["B"], r["H"], r["T"], r["D"], r["causal"]) == (B, H, T, D, causal)}
    best = {k: min(ms for n, ms in cell.items() if n.startswith(k)) for k in KERNELS}
    lines.append(f"B{B} H{H} T{T} hs{D} {'causal' if causal else 'full'} | "
                 + " | ".join(f"{cell['cudnn'] / ms:.3f}" for n, ms in cell.items() if n != "cudnn")
                 + " | " + " | ".join(f"{cell['cudnn'] / best[k]:.3f}" for k in KERNELS))
with open(f"{out_dir}/acc_table.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), file=sys.stderr)
