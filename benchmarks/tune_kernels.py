"""Sweep of the dense Triton kernels' tiles against cuDNN, on the GPU.

    python -m benchmarks.tune_kernels --out_dir out/tune --jobs 4

For each shape it runs one forward and backward with widened tile tables: the kernels' own tuner
(attention/triton_flash.py _launch) times every candidate (the forward's with and without tensor-
descriptor loads, §9), and this script keeps those timings (triton_flash.tuning_log) with the
registers, spills and wgmma instructions of the chosen tile, the whole passes with the chosen tiles,
and PyTorch's cuDNN attention on the same inputs. With --jobs N, N processes first compile every
shape's candidates (Triton's disk cache keeps the binaries), so the timing pass, alone on the GPU,
does not wait on the compiler. For choosing HOPPER_TILES and finding what to change next
(docs/perf_notes.md); benchmarks/attention.py is the benchmark.
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
# wider than HOPPER_TILES: (BLOCK_M, BLOCK_N, num_warps, num_stages), by head dim
SWEEP_TILES = {
    "fwd": {
        64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 4),
             (64, 128, 4, 3), (128, 32, 4, 4), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 3)],
        128: [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2),
              (128, 32, 4, 3), (128, 64, 8, 2)],
    },
    "dq": {
        64: [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 8, 2), (128, 128, 8, 2),
             (64, 64, 4, 2), (64, 32, 4, 3), (32, 64, 4, 3), (128, 64, 4, 2)],
        128: [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 8, 2), (64, 32, 4, 2)],
    },
    "dkdv": {
        64: [(64, 128, 8, 3), (64, 128, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (32, 64, 4, 2),
             (16, 64, 4, 2), (32, 64, 4, 3), (32, 128, 4, 2), (16, 128, 4, 3), (32, 32, 4, 2), (64, 64, 4, 2)],
        128: [(64, 64, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (32, 64, 4, 2), (64, 64, 4, 3)],
    },
}


def inputs(shape: Shape):
    q, k, v, do = (torch.randn(shape.B, shape.nh, shape.T, shape.hs, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    return q, k, v, do


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def run_job(shape: Shape) -> dict:
    """Tune every kernel of one shape, then time the passes with the chosen tiles."""
    triton_flash.HOPPER_TILES = SWEEP_TILES
    triton_flash.TMA_MODE = "1"  # the forward's candidates with and without descriptor loads
    triton_flash.tuning_log = []
    triton_flash._best_tile.clear()
    q, k, v, do = inputs(shape)
    scale = shape.hs ** -0.5
    o, lse = triton_flash.forward(q, k, v, shape.causal, scale)
    triton_flash.backward(do, q, k, v, o, lse, shape.causal, scale)
    passes = {"fwd": time_ms(lambda: triton_flash.forward(q, k, v, shape.causal, scale)),
              "bwd": time_ms(lambda: triton_flash.backward(do, q, k, v, o, lse, shape.causal, scale))}
    kernels = {}
    for entry in triton_flash.tuning_log:
        times = {f"{tile}{' tma' if tma else ''}": t for (tile, tma), t in entry["times_ms"].items()}
        best = min(times, key=times.get)
        kernels[entry["kernel"]] = dict(best=best, best_ms=times[best], times_ms=times,
                                        **{k: entry[k] for k in ("registers", "spills", "wgmma")})
    return dict(shape=str(shape), passes_ms=passes, kernels=kernels)


def cudnn_ms(shape: Shape) -> dict:
    q, k, v, do = inputs(shape)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        fwd = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)  # noqa: E731
        out = fwd()
        bwd = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
        return {"fwd": time_ms(fwd), "bwd": time_ms(bwd)}


def table(results: list[dict], cudnn: dict) -> str:
    lines = ["| shape | fwd ms (cuDNN / ours) | bwd ms (cuDNN / ours) | fwd+bwd TFLOP/s | chosen tiles: fwd / dq / dkdv |",
             "|---|---|---|---|---|"]
    for r in results:
        ref, p = cudnn[r["shape"]], r["passes_ms"]
        shape = next(s for s in SHAPES if str(s) == r["shape"])
        tflops = attention_flops(shape.B, shape.nh, shape.T, shape.hs, shape.causal, "fwd+bwd") / (
            p["fwd"] + p["bwd"]) / 1e9
        tiles = " / ".join(f"{r['kernels'][k]['best']} ({r['kernels'][k]['registers']} regs, "
                           f"{r['kernels'][k]['spills']} spills)" for k in ("fwd", "dq", "dkdv"))
        lines.append(f"| {r['shape']} | {p['fwd']:.3f} ({ref['fwd'] / p['fwd']:.2f}) | {p['bwd']:.3f} "
                     f"({ref['bwd'] / p['bwd']:.2f}) | {tflops:.0f} | {tiles} |")
    lines.append("\ncuDNN (ms): " + ", ".join(f"{s}: fwd {t['fwd']:.3f} bwd {t['bwd']:.3f}" for s, t in cudnn.items()))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="out/tune")
    p.add_argument("--jobs", type=int, default=1, help="> 1: compile every shape in its own process first")
    p.add_argument("--head_dims", default="64,128", help="comma-separated: only the shapes with these head dims")
    p.add_argument("--part", type=int, default=None, help="(internal) compile only shape number PART of those kept")
    args = p.parse_args(argv)
    shapes = [shape for shape in SHAPES if shape.hs in [int(d) for d in args.head_dims.split(",")]]
    if args.part is not None:  # a compile worker: its timings are thrown away
        run_job(shapes[args.part])
        return
    if args.jobs > 1:
        for i, worker in enumerate([subprocess.Popen([sys.executable, "-m", "benchmarks.tune_kernels", "--part", str(i),
                                                      "--head_dims", args.head_dims],
                                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                                    for i in range(len(shapes))]):
            err = worker.communicate()[1].decode()
            if worker.returncode:
                print(f"compile worker {i} failed:\n{err[-1500:]}", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cudnn = {str(s): cudnn_ms(s) for s in shapes}
    results = []
    for shape in shapes:
        results.append(run_job(shape))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "kernels"}), flush=True)
        write_json(out / "results.json", dict(environment=environment(torch.device("cuda")), cudnn_ms=cudnn,
                                              results=results))
    (out / "results.md").write_text(table(results, cudnn) + "\n")
    print(table(results, cudnn))


if __name__ == "__main__":
    main()
