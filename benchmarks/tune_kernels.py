"""Sweep of the dense Triton kernels' tiles and Hopper features against cuDNN, on the GPU.

    python -m benchmarks.tune_kernels --out_dir out/tune --jobs 12

For each shape and variant it runs one forward and both backwards with widened tile tables: the
kernels' own tuner (attention/triton_flash.py _launch) times every candidate, and this script keeps
those timings (tuning_log), the fastest tile per kernel, the whole passes with those tiles, and
PyTorch's cuDNN attention on the same inputs. Variants:
  ptr      tiles loaded by pointer arithmetic (NANOFLASH_TMA=0)
  tma      tiles loaded through tensor descriptors (§9 TMA)
  tma+ws   and the main loops warp-specialized (NANOFLASH_WARP_SPECIALIZE=1)
Backwards: "fused" (one dK/dV kernel adding dQ with atomics) and "deterministic" (dQ kernel + dK/dV).
With --jobs N, N processes first compile every variant (Triton's disk cache keeps the binaries),
so the timing pass, alone on the GPU, does not wait on the compiler. For finding what to change and
what to put in HOPPER_TILES; benchmarks/attention.py is the benchmark.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import triton_flash
from benchmarks.attention import Shape, attention_flops
from benchmarks.report import environment, write_json

SHAPES = [
    Shape(16, 12, 1024, 64, True, "gpt2"),
    Shape(4, 32, 4096, 64, False, "grid"),
    Shape(4, 16, 4096, 128, True, "grid"),
    Shape(1, 16, 16384, 128, False, "grid"),
]
VARIANTS = {"ptr": ("0", False), "tma": ("auto", False)}  # name: (TMA_MODE, WS)
# wider than HOPPER_TILES: (BLOCK_M, BLOCK_N, num_warps, num_stages), by head dim
SWEEP_TILES = {
    "fwd": {
        64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 4),
             (64, 128, 4, 3), (128, 32, 4, 4)],
        128: [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2),
              (128, 32, 4, 3), (128, 64, 8, 2)],
    },
    "dq": {
        64: [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 8, 2), (128, 128, 8, 2)],
        128: [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 8, 2), (64, 32, 4, 2)],
    },
    "dkdv": {
        64: [(64, 128, 8, 3), (64, 128, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (32, 64, 4, 2)],
        128: [(64, 64, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (32, 64, 4, 2), (64, 64, 4, 3)],
    },
}
SWEEP_TILES["dkdv+dq"] = SWEEP_TILES["dkdv"]


def inputs(shape: Shape):
    q, k, v, do = (torch.randn(shape.B, shape.nh, shape.T, shape.hs, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    return q, k, v, do


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def run_job(shape: Shape, variant: str) -> dict:
    """Tune every kernel of one shape and variant, then time the passes with the chosen tiles."""
    triton_flash.TMA_MODE, triton_flash.WARP_SPECIALIZE = VARIANTS[variant]
    triton_flash.HOPPER_TILES = SWEEP_TILES
    triton_flash.tuning_log = []
    triton_flash._best_tile.clear()
    q, k, v, do = inputs(shape)
    scale = shape.hs ** -0.5
    o, lse = triton_flash.forward(q, k, v, shape.causal, scale)
    backward = {name: (lambda det=det: triton_flash.backward(do, q, k, v, o, lse, shape.causal, scale,
                                                              deterministic=det))
                for name, det in (("fused", False), ("deterministic", True))}
    for fn in backward.values():
        fn()
    passes = {"fwd": time_ms(lambda: triton_flash.forward(q, k, v, shape.causal, scale))}
    passes |= {f"bwd {name}": time_ms(fn) for name, fn in backward.items()}
    kernels = {}
    for entry in triton_flash.tuning_log:
        times = {str(tile): t for tile, t in entry["times_ms"].items()}
        best = min(times, key=times.get)
        kernels[entry["kernel"]] = dict(best=best, best_ms=times[best], times_ms=times,
                                        **{k: entry[k] for k in ("registers", "spills", "wgmma")})
    return dict(shape=str(shape), variant=variant, passes_ms=passes, kernels=kernels,
                tma_used=triton_flash._use_tma(q, k, v, o))


def cudnn_ms(shape: Shape) -> dict:
    q, k, v, do = inputs(shape)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        fwd = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)  # noqa: E731
        out = fwd()
        bwd = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
        return {"fwd": time_ms(fwd), "bwd": time_ms(bwd)}


def jobs():
    return [(shape, variant) for variant in VARIANTS for shape in SHAPES]  # ws last: the least tried


def table(results: list[dict], cudnn: dict) -> str:
    lines = ["| shape | variant | fwd ms (x cuDNN) | bwd fused ms (x cuDNN) | bwd det. ms | fwd+bwd TFLOP/s | "
             "best tiles fwd / dkdv+dq / dq / dkdv |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['variant']} | error: {r['error'][:80]} | | | | |")
            continue
        ref, p = cudnn[r["shape"]], r["passes_ms"]
        shape = next(s for s in SHAPES if str(s) == r["shape"])
        tflops = attention_flops(shape.B, shape.nh, shape.T, shape.hs, shape.causal, "fwd+bwd") / (
            p["fwd"] + p["bwd fused"]) / 1e9
        tiles = " / ".join(r["kernels"].get(k, {}).get("best", "-") for k in ("fwd", "dkdv+dq", "dq", "dkdv"))
        lines.append(f"| {r['shape']} | {r['variant']} | {p['fwd']:.3f} ({ref['fwd'] / p['fwd']:.2f}) | "
                     f"{p['bwd fused']:.3f} ({ref['bwd'] / p['bwd fused']:.2f}) | {p['bwd deterministic']:.3f} | "
                     f"{tflops:.0f} | {tiles} |")
    lines.append("\ncuDNN (ms): " + ", ".join(f"{s}: fwd {t['fwd']:.3f} bwd {t['bwd']:.3f}" for s, t in cudnn.items()))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="out/tune")
    p.add_argument("--jobs", type=int, default=1, help="processes that compile every variant before the timing pass")
    p.add_argument("--part", type=int, default=None, help="(internal) compile only job number PART")
    args = p.parse_args(argv)
    if args.part is not None:  # a compile worker: its timings are thrown away
        shape, variant = jobs()[args.part]
        run_job(shape, variant)
        return
    if args.jobs > 1:
        workers = [subprocess.Popen([sys.executable, "-m", "benchmarks.tune_kernels", "--part", str(i)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(len(jobs()))]
        for i, w in enumerate(workers):
            err = w.communicate()[1].decode()
            if w.returncode:
                print(f"compile worker {i} ({jobs()[i][1]}) failed:\n{err[-1500:]}", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cudnn = {str(s): cudnn_ms(s) for s in SHAPES}
    results = []
    for shape, variant in jobs():
        try:
            results.append(run_job(shape, variant))
        except Exception as e:  # a variant the compiler rejects is a result too
            results.append(dict(shape=str(shape), variant=variant, error=f"{type(e).__name__}: {e}"))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "kernels"}), flush=True)
        write_json(out / "results.json", dict(environment=environment(torch.device("cuda")), cudnn_ms=cudnn, results=results))
    (out / "results.md").write_text(table(results, cudnn) + "\n")
    print(table(results, cudnn))


if __name__ == "__main__":
    main()
