"""Probe: two changes at the edges of the Hopper forward's work items (§12), tile for tile against HEAD's kernel.
  release   consumers whose 64 rows all lie past Tq (the last item of a head when 64 * CONSUMERS does not divide
            Tq) take one key tile and release the rest unread, instead of computing on zero rows;
  package   that, and two Q buffers at hs=64, so the next item's Q loads while the consumers finish this one.
HEAD's kernel and `release` travel as .gpu_carry/triton_hopper_head.py and .gpu_carry/triton_hopper_release.py
(6abd97e's attention/triton_hopper.py, and the same with the first change; imports made absolute). First float64
checks of every hs=64 tile of both new kernels on odd shapes, then the hs=64 forward cells beside cuDNN (do_bench
median over three rounds in rotating order), the package's tuner too. bf16.

    git show 6abd97e:attention/triton_hopper.py | sed 's/^from .launch/from attention.launch/' \
        > .gpu_carry/triton_hopper_head.py
    cp .gpu_carry/triton_hopper_head.py .gpu_carry/triton_hopper_release.py
    patch .gpu_carry/triton_hopper_release.py benchmarks/results/2026-11-22-h200-item-edges/release.patch
    PYTHONPATH=$PWD python3 benchmarks/results/2026-11-22-h200-item-edges/edges_probe.py OUT_DIR
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


def carried(name):
    spec = importlib.util.spec_from_file_location(name, f".gpu_carry/triton_hopper_{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KERNELS = {"head": carried("head"), "release": carried("release"), "package": triton_hopper}
TILES = triton_hopper.TILES[64]
out_dir = sys.argv[1]
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

# float64 checks: ragged (1000 rows: the last 192-row item has two consumers past Tq), 1024 rows (the same, whole),
# Tq < Tk and Tq > Tk under the causal mask (rows that see no key), shorter than a tile, GQA, more items than SMs
checks = []
for B, Hq, Hkv, Tq, Tk, causal in [(2, 4, 4, 1000, 1000, True), (2, 4, 4, 1024, 1024, False),
                                   (2, 4, 2, 300, 1000, True), (2, 4, 2, 1000, 300, True), (1, 2, 2, 50, 50, False),
                                   (1, 131, 131, 300, 300, True), (4, 8, 2, 1000, 1000, False)]:
    torch.manual_seed(0)
    q = torch.randn(B, Hq, Tq, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, Tk, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kr, vr = (t.repeat_interleave(Hq // Hkv, 1) for t in (k, v))
    mask = torch.ones(Tq, Tk, dtype=torch.bool, device="cuda").tril(Tk - Tq) if causal else None
    exact = F.scaled_dot_product_attention(q.double(), kr.double(), vr.double(), attn_mask=mask)
    math = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
    seen = mask.any(-1)[None, None, :, None] if causal else torch.ones(1, dtype=torch.bool, device="cuda")
    exact, math = exact.nan_to_num(0.0) * seen, math.nan_to_num(0.0) * seen  # rows that see no key: O = 0
    bound = 2 * (math.double() - exact).abs().max().item() + 1e-5
    for name in ("release", "package"):
        for tile in TILES:
            o = torch.full_like(q, float("nan"))
            lse = torch.empty(B, Hq, Tq, device="cuda")
            for _ in range(5):
                KERNELS[name].forward(q, k, v, o, lse, causal, 64 ** -0.5, tile)
            err = (o.double() - exact).abs().max().item()
            checks.append(dict(shape=(B, Hq, Hkv, Tq, Tk, causal), kernel=name, tile=tile, err=err, bound=bound,
                               ok=err <= bound))
            print(json.dumps(checks[-1]), flush=True)
with open(f"{out_dir}/checks.json", "w") as f:
    json.dump(checks, f, indent=1)

CELLS = [(16, 12, 1024, 64, True)] + [(16384 // T, 32, T, 64, causal) for causal in (True, False)
                                      for T in (1024, 4096, 16384)]
rows = []
for B, H, T, D, causal in CELLS:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o, lse = triton_flash.empty_bthd(B, H, T, D, q), torch.empty(B, H, T, device="cuda")
    runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    for name, kernel in KERNELS.items():
        for tile in TILES:
            runs[f"{name}{tile}"] = lambda kernel=kernel, tile=tile: kernel.forward(q, k, v, o, lse, causal, D ** -0.5,
                                                                                    tile)
    runs["tuner"] = lambda: attention(q, k, v, causal=causal, backend="triton")
    times, diffs = {name: [] for name in runs}, {}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
        for name, fn in runs.items():
            o.fill_(float("nan"))
            result = fn()
            out = result if name in ("cudnn", "tuner") else o
            diffs[name] = (out.float() - ref.float()).abs().max().item()
        names = list(runs)
        for r in range(3):
            for name in names[r * 5 % len(names):] + names[:r * 5 % len(names)]:
                times[name].append(triton.testing.do_bench(runs[name], rep=100, return_mode="median"))
    tuned = str(triton_flash.tuned_choices(D, causal, torch.bfloat16, T, T).get("fwd"))
    for name in runs:
        row = dict(B=B, H=H, T=T, D=D, causal=causal, name=name, ms=statistics.median(times[name]),
                   rounds_ms=times[name], max_diff_vs_cudnn=diffs[name], tuner_choice=tuned, **meta)
        rows.append(row)
        print(json.dumps(row), flush=True)
with open(f"{out_dir}/edges.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)

# cuDNN's time over each kernel's time, tile for tile; then each kernel's best
tuned_of = {(r["B"], r["H"], r["T"], r["causal"]): r["tuner_choice"] for r in rows}
lines = [f"float64 checks: {sum(c['ok'] for c in checks)} of {len(checks)} passed",
         "cell | tile | head | release | package"]
for B, H, T, D, causal in CELLS:
    cell = {r["name"]: r["ms"] for r in rows if (r["B"], r["H"], r["T"], r["causal"]) == (B, H, T, causal)}
    name = f"B{B} H{H} T{T} {'causal' if causal else 'full'}"
    for tile in TILES:
        lines.append(f"{name} | {tile} | " + " | ".join(f"{cell['cudnn'] / cell[f'{k}{tile}']:.3f}" for k in KERNELS))
    best = {k: max(cell["cudnn"] / cell[f"{k}{tile}"] for tile in TILES) for k in KERNELS}
    lines.append(f"{name} | best | " + " | ".join(f"{best[k]:.3f}" for k in KERNELS)
                 + f" | tuner {cell['cudnn'] / cell['tuner']:.3f} {tuned_of[(B, H, T, causal)]}")
with open(f"{out_dir}/edges_table.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), file=sys.stderr)
