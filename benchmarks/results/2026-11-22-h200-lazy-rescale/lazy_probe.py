"""Probe: the forward with the lazy rescale (§2) against the forward before it, side by side with cuDNN.

    git apply benchmarks/results/2026-11-22-h200-lazy-rescale/lazy_rescale.patch   # the kernel as measured
    git show HEAD:attention/triton_flash.py > /tmp/baseline_flash.py
    PYTHONPATH=$PWD python3 benchmarks/results/2026-11-22-h200-lazy-rescale/lazy_probe.py /tmp/baseline_flash.py OUT_DIR

baseline_flash.py: attention/triton_flash.py as of the commit before the change (git show). Variants per
cell: cudnn, baseline, lazy (each Triton module tunes its own tile), and lazy capped at 128 registers at
hs=64 (ptxas gives the lazy kernel 148-167 registers where the baseline took 128, which halves the
8-warp tile's blocks per SM). Rounds are interleaved so clock drift hits every variant alike."""
import importlib.util
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import triton_flash as lazy

spec = importlib.util.spec_from_file_location("baseline_flash", sys.argv[1])
base = importlib.util.module_from_spec(spec)
spec.loader.exec_module(base)
out_dir = sys.argv[2]

CELLS = [(16, 12, 1024, 64, True, 1.0)]  # GPT-2's shape
for hs in (64, 128):
    for causal in (True, False):
        for T in (1024, 4096, 16384):
            CELLS.append((16384 // T, 2048 // hs, T, hs, causal, 1.0))
# queries 4x larger, so scores spread 4x wider: rows' maxes grow past the slack more often (the branch's cost)
CELLS += [(4, 16, 4096, 128, True, 4.0), (16, 12, 1024, 64, True, 4.0)]


class Capped:
    """_attn_fwd launched with maxnreg=cap: ptxas keeps to cap registers per thread."""

    def __init__(self, jit_fn, cap):
        self.jit_fn, self.cap = jit_fn, cap

    def __getitem__(self, grid):
        launch = self.jit_fn[grid]
        return lambda *args, **kw: launch(*args, **kw, maxnreg=self.cap)


def main():
    lazy_fwd = lazy._attn_fwd
    capped_tiles = {}
    rows = []
    for B, H, T, D, causal, spread in CELLS:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        q = q * spread
        scale = D ** -0.5
        variants = {
            "cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
            "baseline": lambda: base.forward(q, k, v, causal, scale),
            "lazy": lambda: lazy.forward(q, k, v, causal, scale),
        }
        if D == 64:
            def capped():
                saved = lazy._attn_fwd, lazy._best_tile
                lazy._attn_fwd, lazy._best_tile = Capped(lazy_fwd, 128), capped_tiles  # its own tuning
                try:
                    return lazy.forward(q, k, v, causal, scale)
                finally:
                    lazy._attn_fwd, lazy._best_tile = saved
            variants["lazy_cap128"] = capped
        outs = {}
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for name, f in variants.items():
                t0 = time.time()
                o = f()
                outs[name] = o[0] if isinstance(o, tuple) else o
                torch.cuda.synchronize()
                print(f"  {name} first call (tune+compile) {time.time() - t0:.1f}s", flush=True)
            times = {name: [] for name in variants}
            for _ in range(3):
                for name, f in variants.items():
                    times[name].append(triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median"))
        ms = {name: statistics.median(t) for name, t in times.items()}
        diff = {name: (outs[name].float() - outs["baseline"].float()).abs().max().item() for name in outs}
        row = dict(B=B, H=H, T=T, D=D, causal=causal, spread=spread, ms=ms, max_abs_diff_vs_baseline=diff,
                   tiles={"baseline": {str(k): v for k, v in base._best_tile.items()},
                          "lazy": {str(k): v for k, v in lazy._best_tile.items()},
                          "lazy_cap128": {str(k): v for k, v in capped_tiles.items()}})
        for tiles in (base._best_tile, lazy._best_tile, capped_tiles):
            tiles.clear()
        rows.append(row)
        ratio = " ".join(f"{n} {ms['cudnn'] / t:.3f}x" for n, t in ms.items() if n != "cudnn")
        print(f"B={B} H={H} T={T} D={D} causal={causal} spread={spread}: cudnn {ms['cudnn']:.4f} ms | {ratio} | "
              f"diff {diff}", flush=True)
        with open(f"{out_dir}/lazy_probe.json", "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           date=time.strftime("%Y-%m-%dT%H:%M:%S"), rows=rows), f, indent=1)
    print("\n| cell | cuDNN ms | baseline | lazy | lazy, 128 regs |\n|---|---|---|---|---|")
    for r in rows:
        ms = r["ms"]
        cells = [f"{ms['cudnn'] / ms[n]:.3f}x" if n in ms else "-" for n in ("baseline", "lazy", "lazy_cap128")]
        print(f"| B={r['B']} H={r['H']} T={r['T']} hs={r['D']} {'causal' if r['causal'] else 'full'}"
              f"{' x' + str(r['spread']) if r['spread'] != 1 else ''} | {ms['cudnn']:.4f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
