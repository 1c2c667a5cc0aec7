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

    python -m benchmarks.tune_kernels --masks window,documents --out_dir out/tune-sparse

sweeps the block-sparse kernels instead (§10), with benchmarks/sparse.py's masks at T=16k; no
cuDNN there (benchmarks/sparse.py compares them with FlexAttention).
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import BlockMask, triton_flash
from attention.triton_op import kernel_mask_args
from benchmarks.attention import Shape
from benchmarks.report import environment, write_json
from benchmarks.sparse import MASKS, packed_document_ids

SHAPES = [
    Shape(16, 12, 1024, 64, True, "gpt2"),
    Shape(4, 32, 4096, 64, False, "grid"),
    Shape(4, 16, 4096, 128, True, "grid"),
    Shape(1, 16, 16384, 128, False, "grid"),
]
SPARSE_SHAPES = [Shape(1, 32, 16384, 64, True, "grid"), Shape(1, 16, 16384, 128, True, "grid")]
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
        128: [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 8, 2), (64, 32, 4, 2),
              (64, 32, 4, 3), (64, 64, 4, 2), (32, 64, 4, 3), (32, 32, 4, 3)],
    },
    "dkdv": {
        64: [(64, 128, 8, 3), (64, 128, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (32, 64, 4, 2),
             (16, 64, 4, 2), (32, 64, 4, 3), (32, 128, 4, 2), (16, 128, 4, 3), (32, 32, 4, 2), (64, 64, 4, 2)],
        128: [(64, 64, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (32, 64, 4, 2), (64, 64, 4, 3),
              (32, 64, 4, 3), (16, 64, 4, 2), (32, 32, 4, 3), (64, 64, 4, 2), (32, 128, 4, 3)],
    },
}


def inputs(shape: Shape):
    q, k, v, do = (torch.randn(shape.B, shape.nh, shape.T, shape.hs, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    return q, k, v, do


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def benchmark_mask(family: str, shape: Shape) -> triton_flash.MaskArgs:
    """The kernels' arguments for one of benchmarks/sparse.py's masks on this shape ("dense": none)."""
    if family == "dense":
        return triton_flash.DENSE
    if family == "window":
        rules = dict(window=(MASKS["gpu"]["window"], 0))
    else:
        rules = dict(document_ids=packed_document_ids(shape.B, shape.T, MASKS["gpu"]["doc_lengths"], 0, "cuda"))
    return kernel_mask_args(BlockMask.from_rules(shape.T, shape.T, causal=shape.causal, device="cuda", **rules))


def run_job(shape: Shape, family: str = "dense") -> dict:
    """Tune every kernel of one shape, then time the passes with the chosen tiles."""
    triton_flash.HOPPER_TILES = SWEEP_TILES
    triton_flash.TMA_MODE = "1"  # the forward's candidates with and without descriptor loads
    triton_flash.tuning_log = []
    triton_flash._best_tile.clear()
    q, k, v, do = inputs(shape)
    scale = shape.hs ** -0.5
    mask = benchmark_mask(family, shape)
    o, lse = triton_flash.forward(q, k, v, shape.causal, scale, mask)
    triton_flash.backward(do, q, k, v, o, lse, shape.causal, scale, mask)
    passes = {"fwd": time_ms(lambda: triton_flash.forward(q, k, v, shape.causal, scale, mask)),
              "bwd": time_ms(lambda: triton_flash.backward(do, q, k, v, o, lse, shape.causal, scale, mask))}
    kernels = {}
    for entry in triton_flash.tuning_log:
        if entry["kernel"] == "bwd":  # §13's kernel (its tiles) against the `tl` pair (None), each tuned above
            times = {"tl" if tile is None else f"{tile} hopper": t for tile, t in entry["times_ms"].items()}
            kernels["bwd"] = dict(best=min(times, key=times.get), best_ms=min(times.values()), times_ms=times)
            continue
        times = {f"{tile}{' ' + variant if variant in ('tma', 'hopper') else ''}": t
                 for (tile, variant), t in entry["times_ms"].items()}
        best = min(times, key=times.get)
        kernels[entry["kernel"]] = dict(best=best, best_ms=times[best], times_ms=times,
                                        **{k: entry[k] for k in ("registers", "spills", "wgmma")})
    return dict(shape=str(shape), mask=family, passes_ms=passes, kernels=kernels)


def cudnn_ms(shape: Shape) -> dict:
    q, k, v, do = inputs(shape)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        fwd = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)  # noqa: E731
        out = fwd()
        bwd = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
        return {"fwd": time_ms(fwd), "bwd": time_ms(bwd)}


def table(results: list[dict], cudnn: dict) -> str:
    lines = ["| shape | mask | fwd ms (cuDNN / ours) | bwd ms (cuDNN / ours) | chosen tiles: fwd / dq / dkdv |",
             "|---|---|---|---|---|"]
    for r in results:
        ref, p = cudnn.get(r["shape"]), r["passes_ms"]
        ratio = {pass_: f" ({ref[pass_] / p[pass_]:.2f})" if ref else "" for pass_ in ("fwd", "bwd")}
        tiles = " / ".join(f"{r['kernels'][k]['best']} ({r['kernels'][k]['registers']} regs, "
                           f"{r['kernels'][k]['spills']} spills)" for k in ("fwd", "dq", "dkdv"))
        lines.append(f"| {r['shape']} | {r['mask']} | {p['fwd']:.3f}{ratio['fwd']} | {p['bwd']:.3f}{ratio['bwd']} "
                     f"| {tiles} |")
    lines.append("\ncuDNN (ms): " + ", ".join(f"{s}: fwd {t['fwd']:.3f} bwd {t['bwd']:.3f}" for s, t in cudnn.items()))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="out/tune")
    p.add_argument("--jobs", type=int, default=1, help="> 1: compile every shape in its own process first")
    p.add_argument("--head_dims", default="64,128", help="comma-separated: only the shapes with these head dims")
    p.add_argument("--masks", default="dense", help="dense (against cuDNN), or block-sparse: window,documents")
    p.add_argument("--part", type=int, default=None, help="(internal) compile only job number PART")
    args = p.parse_args(argv)
    head_dims = [int(d) for d in args.head_dims.split(",")]
    masks = args.masks.split(",")
    jobs = [(shape, mask) for mask in masks for shape in (SHAPES if mask == "dense" else SPARSE_SHAPES)
            if shape.hs in head_dims]
    if args.part is not None:  # a compile worker: its timings are thrown away
        run_job(*jobs[args.part])
        return
    if args.jobs > 1:
        for i, worker in enumerate([subprocess.Popen([sys.executable, "-m", "benchmarks.tune_kernels", "--part", str(i),
                                                      "--head_dims", args.head_dims, "--masks", args.masks],
                                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                                    for i in range(len(jobs))]):
            err = worker.communicate()[1].decode()
            if worker.returncode:
                print(f"compile worker {i} failed:\n{err[-1500:]}", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cudnn = {str(shape): cudnn_ms(shape) for shape, mask in jobs if mask == "dense"}
    results = []
    for shape, mask in jobs:
        results.append(run_job(shape, mask))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "kernels"}), flush=True)
        write_json(out / "results.json", dict(environment=environment(torch.device("cuda")), cudnn_ms=cudnn,
                                              results=results))
    (out / "results.md").write_text(table(results, cudnn) + "\n")
    print(table(results, cudnn))


if __name__ == "__main__":
    main()
