"""Packed documents (issue 38): every way to keep attention inside documents, side by side in one run.

    python -m benchmarks.documents                       # the GPU grid, bf16 -> out/documents/
    python -m benchmarks.documents --device cpu          # toy sizes (tests)

A batch of B rows of T tokens (B*T = --tokens) holds documents of uneven length: each row is cut at --docs_per_row - 1
random points. Every implementation gets the same documents and q, k, v in a model's layout ((B, T, H, D) storage),
forward+backward through autograd:
    per call         attention(..., document_ids=ids) with one ids tensor, as each layer of a model passes it: the
                     block mask comes from the per-ids cache (built by the first call, untimed)
    prebuilt         attention(..., block_mask=mask), the mask built once (untimed)
    varlen           attention_varlen over the (B*T, H, D) rows and the documents' cu_seqlens
    flex             the flex backend (FlexAttention, compiled) on the same BlockMask, converted once (untimed)
    dense causal     attention(..., causal=True) on whole rows: what masking saves
    prebuilt again   prebuilt once more: an A/A pair, the run's own noise
Builds, timed on their own: our BlockMask with what its kernels take (the block lists, and on Hopper each position's
document span: what a training step builds once) and Flex's create_block_mask. Rounds rotate the order; each cell is
the median of its rounds' medians.
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python benchmarks/documents.py`: see attention.py

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported, as in attention.py

from attention import BlockMask, attention, attention_varlen
from attention.flash.autograd import kernel_mask_args
from benchmarks.attention import DTYPES, comma_list, median_ms, warm_up_gpu
from benchmarks.sparse import visible_pairs
from benchmarks.report import default_out_dir, environment, markdown_table, pyplot, rotations, save_png, write_json

GRIDS = {"gpu": {"seq_lens": [4096, 16384], "head_dims": [64, 128], "tokens": 16384, "width": 2048},
         "toy": {"seq_lens": [64, 128], "head_dims": [16], "tokens": 256, "width": 32}}


def uneven_documents(B: int, T: int, docs_per_row: int, seed: int) -> torch.Tensor:
    """(B, T) int32 document ids: each row cut at docs_per_row - 1 distinct random points (lengths uneven)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        cuts = torch.randperm(T - 1, generator=gen)[: docs_per_row - 1] + 1
        starts = torch.zeros(T, dtype=torch.int32)
        starts[cuts] = 1
        rows.append(starts.cumsum(0, dtype=torch.int32))
    return torch.stack(rows)


def cu_seqlens(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The documents of every row, packed row after row: (n + 1,) int32 offsets and the longest length."""
    lengths = torch.cat([torch.unique_consecutive(row, return_counts=True)[1] for row in document_ids.cpu()])
    return F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32), int(lengths.max())


def implementations(ids: torch.Tensor, B: int, T: int, device, flex: bool) -> tuple[dict, dict]:
    """-> (name -> fn(q, k, v) on (B, H, T, D) views, or on (B*T, H, D) rows for varlen; name -> a build to time)."""
    mask = BlockMask.from_rules(T, T, causal=True, document_ids=ids)
    kernel_mask_args(mask)  # the block lists (and spans), built once as a model's first layer builds them
    cu, longest = cu_seqlens(ids)
    cu = cu.to(device)
    fns = {
        "per call": lambda q, k, v: attention(q, k, v, backend="triton", document_ids=ids),
        "prebuilt": lambda q, k, v: attention(q, k, v, backend="triton", block_mask=mask),
        "varlen": lambda q, k, v: attention_varlen(q, k, v, cu, cu, longest, longest, causal=True),
        "dense causal": lambda q, k, v: attention(q, k, v, backend="triton"),
        "prebuilt again": lambda q, k, v: attention(q, k, v, backend="triton", block_mask=mask),
    }

    def our_build():  # what a step builds: the block lists, and on Hopper the spans its kernels take (§14)
        return kernel_mask_args(BlockMask.from_rules(T, T, causal=True, document_ids=ids))
    builds = {"ours": our_build}
    if flex:  # the registry's flex backend converts the BlockMask into Flex's once; the build is that conversion
        from attention.reference.flex import flex_block_mask

        fns["flex"] = lambda q, k, v: attention(q, k, v, backend="flex", block_mask=mask)
        builds["flex"] = lambda: flex_block_mask(mask)
    return fns, builds


def measure_cell(B, T, H, D, args, device, dtype) -> dict:
    torch._dynamo.reset()
    ids = uneven_documents(B, T, args.docs_per_row, args.seed).to(device)
    fns, builds = implementations(ids, B, T, device, args.flex)
    storage = [torch.randn(B, T, H, D, device=device, dtype=dtype, requires_grad=True) for _ in range(4)]
    q, k, v, dout = storage
    views = [t.transpose(1, 2) for t in (q, k, v)]  # (B, H, T, D), strided as a model's
    rows = [t.view(B * T, H, D) for t in (q, k, v)]  # the same storage as packed rows

    def step(name):
        inputs, grad = (rows, dout.view(B * T, H, D)) if name == "varlen" else (views, dout.transpose(1, 2))
        return lambda: fns[name](*inputs).backward(grad)
    for name in fns:  # compile, tune, fill the caches
        step(name)()
    times = {name: [] for name in fns}
    for order in rotations(list(fns), args.rounds):
        for name in order:
            times[name].append(median_ms(step(name), [q, k, v], device, args.rep_ms))
    build_times = {name: [] for name in builds}
    for order in rotations(list(builds), args.rounds):
        for name in order:
            build_times[name].append(median_ms(builds[name], [], device, args.rep_ms))
    pairs = visible_pairs("documents", B, T, args, ids)
    return {"B": B, "T": T, "H": H, "D": D, "visible_pairs": pairs,
            "ms": {name: statistics.median(t) for name, t in times.items()}, "rounds_ms": times,
            "build_ms": {name: statistics.median(t) for name, t in build_times.items()}}


def report(results: dict) -> str:
    env, cells = results["env"], results["cells"]
    names = list(cells[0]["ms"])
    header = ["D", "T", *[f"{n} ms" for n in names], "flex / varlen", "flex / per call", "build ms (ours)",
              "build ms (flex)"]
    lines = []
    for c in cells:
        ms = c["ms"]
        ratio = (lambda a, b: f"{ms[a] / ms[b]:.2f}x" if a in ms else "-")
        lines.append([str(c["D"]), str(c["T"]), *[f"{ms[n]:.3f}" for n in names], ratio("flex", "varlen"),
                      ratio("flex", "per call"), f"{c['build_ms']['ours']:.3f}",
                      f"{c['build_ms']['flex']:.3f}" if "flex" in c["build_ms"] else "-"])
    return (f"# Packed documents\n\n{env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, "
            f"{results['settings']['dtype']}, forward+backward, {results['settings']['tokens']} tokens per batch, "
            f"{results['settings']['docs_per_row']} documents per row, median of {results['settings']['rounds']} "
            "rotating rounds.\n\n" + markdown_table(header, lines) + "\n")


def plot(results: dict, path: Path) -> None:
    """Grouped bars: each cell's forward+backward time per implementation."""
    plt = pyplot()
    if plt is None:
        return
    cells = results["cells"]
    names = [n for n in cells[0]["ms"] if n != "prebuilt again"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([c + i * width for c in range(len(cells))], [cell["ms"].get(name, 0) for cell in cells], width,
               label=name)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cells))], [f"D={c['D']}, T={c['T']}" for c in cells])
    ax.set_ylabel("forward+backward ms")
    ax.set_title(f"Packed documents, {results['env'].get('gpu')}")
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--seq_lens", type=comma_list(int))
    p.add_argument("--head_dims", type=comma_list(int))
    p.add_argument("--tokens", type=int)
    p.add_argument("--docs_per_row", type=int, default=4)
    p.add_argument("--flex", action=argparse.BooleanOptionalAction, help="FlexAttention too (default on cuda only)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rep_ms", type=float, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out_dir")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    grid = GRIDS["gpu" if device.type == "cuda" else "toy"]
    args.flex = device.type == "cuda" if args.flex is None else args.flex
    args.tokens = args.tokens or grid["tokens"]
    if device.type != "cuda":
        args.dtype = "fp32"  # the interpreter gets bf16 dots wrong
    dtype = DTYPES[args.dtype]
    out_dir = Path(args.out_dir or default_out_dir("documents"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        warm_up_gpu(device)
    settings = {k: getattr(args, k) for k in ("dtype", "tokens", "docs_per_row", "rounds", "rep_ms", "seed")}
    results = {"env": environment(device), "settings": settings, "cells": []}
    for D in args.head_dims or grid["head_dims"]:
        for T in args.seq_lens or grid["seq_lens"]:
            results["cells"].append(measure_cell(max(1, args.tokens // T), T, grid["width"] // D, D, args, device,
                                                 dtype))
            write_json(out_dir / "results.json", results)  # after every cell: a run cut off keeps what it measured
            print(json.dumps({k: results["cells"][-1][k] for k in ("D", "T", "ms", "build_ms")}), flush=True)
    text = report(results)
    (out_dir / "results.md").write_text(text)
    plot(results, out_dir / "documents.png")
    print(text)
    return out_dir


if __name__ == "__main__":
    main()
