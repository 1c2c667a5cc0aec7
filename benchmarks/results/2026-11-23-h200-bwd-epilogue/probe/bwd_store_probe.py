"""Probe (prepared for the next GPU session): the Hopper backward's dK, dV epilogue. The forward's O stored from
registers cost 1.4-2.4 us per work item (benchmarks/results/2026-11-22-h200-item-edges/item-cost/); the backward
stores dK and dV the same way, once per program, and its programs are not persistent (nothing overlaps the
epilogue). Kernels: `package` (attention/triton_hopper_backward.py), `nostore` (.gpu_carry/triton_hopper_backward_
nostore.py: the stores behind a branch never taken), `staged` (.gpu_carry/triton_hopper_backward_staged.py: dK and
dV through the warpgroup's dQ staging tiles, stored by TMA), `vstage` (.gpu_carry/triton_hopper_backward_vstage.py:
dV through the warpgroup's V rows, dK through its K rows once both warpgroups are past their last dQ matmul). First float64 checks of `staged` (dq, dk, dv), then the
main kernel's three launches per cell beside cuDNN's backward, three rotating rounds, do_bench median. bf16.

    PYTHONPATH=$PWD python3 .gpu_carry/bwd_store_probe.py OUT_DIR
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


def load(name):
    spec = importlib.util.spec_from_file_location(name, f".gpu_carry/triton_hopper_backward_{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KERNELS = {"package": triton_hopper_backward, "nostore": load("nostore"), "staged": load("staged"), "vstage": load("vstage")}
out_dir = sys.argv[1]
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
for B, Hq, Hkv, Tq, Tk, D, causal in [(2, 4, 4, 1000, 1000, 64, True), (2, 4, 2, 300, 1000, 128, True),
                                      (1, 4, 1, 777, 777, 128, False), (2, 8, 2, 1000, 1000, 64, False)]:
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
    for variant, stages in [(n, s) for n in ("staged", "vstage") for s in triton_hopper_backward.TILES[D]]:
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        KERNELS[variant].backward(do, q, k, v, o, lse, *grads, causal, D ** -0.5, stages)
        for name, ours, ex, m in zip(("dq", "dk", "dv"), grads, exact, math):
            err, bound = (ours.double() - ex).abs().max().item(), 2 * (m.double() - ex).abs().max().item() + 1e-5
            checks.append(dict(variant=variant, shape=(B, Hq, Hkv, Tq, Tk, D, causal), stages=stages, grad=name, err=err, bound=bound,
                               ok=err <= bound))
            print(json.dumps(checks[-1]), flush=True)
with open(f"{out_dir}/checks.json", "w") as f:
    json.dump(checks, f, indent=1)

CELLS = [(16, 12, 1024, 64, True)] + [(16384 // T, 2048 // D, T, D, causal) for D in (64, 128)
                                      for causal in (True, False) for T in (1024, 4096, 16384)]
rows = []
for B, H, T, D, causal in CELLS:
    q, k, v, do, o, lse = setup(B, H, H, T, T, D, causal)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=causal)
    runs = {"cudnn": lambda: torch.autograd.grad(out, (qc, kc, vc), do, retain_graph=True)}
    for name, kernel in KERNELS.items():
        for stages in kernel.TILES[D]:
            launched = kernel.backward(do, q, k, v, o, lse, *grads, causal, D ** -0.5, stages)
            runs[f"{name}{stages}"] = lambda launched=launched: launched.again(do, q, k, v, o, lse, *grads, D ** -0.5)
    times = {name: [] for name in runs}
    names = list(runs)
    for r in range(3):
        for name in names[r * 2 % len(names):] + names[:r * 2 % len(names)]:
            times[name].append(triton.testing.do_bench(runs[name], rep=100, return_mode="median"))
    for name, ts in times.items():
        rows.append(dict(B=B, H=H, T=T, D=D, causal=causal, name=name, ms=statistics.median(ts), rounds_ms=ts, **meta))
        print(json.dumps(rows[-1]), flush=True)
with open(f"{out_dir}/bwd_store.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)

lines = [f"float64 checks (staged, vstage): {sum(c['ok'] for c in checks)} of {len(checks)} passed",
         "cell | " + " | ".join(KERNELS) + " (best stages; cuDNN's backward time / ours)"]
for B, H, T, D, causal in CELLS:
    cell = {r["name"]: r["ms"] for r in rows if (r["B"], r["H"], r["T"], r["D"], r["causal"]) == (B, H, T, D, causal)}
    best = {k: min(ms for n, ms in cell.items() if n.startswith(k)) for k in KERNELS}
    lines.append(f"B{B} H{H} T{T} hs{D} {'causal' if causal else 'full'} | "
                 + " | ".join(f"{cell['cudnn'] / best[k]:.3f}" for k in KERNELS))
with open(f"{out_dir}/bwd_store_table.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), file=sys.stderr)
