"""Sparse attention benchmark (issue 5): sliding window, packed documents and MoBA through our kernel,
against dense causal attention and FlexAttention with the same mask; forward and forward+backward.

    python -m benchmarks.sparse                        # the GPU grid, bf16 -> out/sparse/
    python -m benchmarks.sparse --quick                # one long T per family, hs=128
    python -m benchmarks.sparse --families dense,moba --head_dims 128
    python -m benchmarks.sparse --resume --out_dir D   # go on where a run that was cut off stopped
    python -m benchmarks.sparse --device cpu           # toy sizes through the naive backend (tests)

Families, each a line of the report (label "<family> <backend>"):
    dense      causal attention: the reference every sparse family is compared with
    window     causal sliding window attention(..., window=(left, 0)), left = --window (1024)
    documents  causal attention within documents of a packed batch: attention(..., document_ids=ids),
               random document lengths in --doc_lengths (100..2000 tokens), the same ids for every backend
    moba       moba_attention(..., block_size=512, topk=3): the selection is part of the timed call
FlexAttention (torch.compile'd flex_attention, block mask built once per shape outside the timing) runs
the same window and document masks on CUDA. Timing, warm-up and failure handling are those of
benchmarks/attention.py; TFLOP/s count only the visible (query, key) pairs of each mask.
"""
import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python benchmarks/sparse.py`: see attention.py

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported, as in attention.py

from tqdm import tqdm

from attention import BlockMask, attention
from attention.reference.flex import compiled_flex, flex_mask_mod as rules_mask_mod
from attention.moba.reference import moba_attention
from benchmarks.attention import (
    DTYPES,
    PASS_FLOP_FACTOR,
    PASSES,
    Shape,
    comma_list,
    failed_cell,
    measure,
)
from benchmarks.report import default_out_dir, environment, write_json
from benchmarks.sparse_report import write_report

FAMILIES = ("dense", "window", "documents", "moba")
FLEX_FAMILIES = ("window", "documents")  # dense flex is in benchmarks/attention.py; MoBA's mask is per query
SEQ_LENS = {  # per family; dense runs at every T of the others, to compare with
    "full": {"window": [4096, 8192, 16384, 32768], "documents": [4096, 8192, 16384], "moba": [8192, 16384, 32768]},
    "quick": {"window": [16384], "documents": [16384], "moba": [32768]},
    "toy": {"window": [64, 128], "documents": [64, 128], "moba": [64, 128]},
}
# what a cell's numbers depend on besides the machine: a resumed run must not mix two of these
CELL_SETTINGS = ("dtype", "backend", "window", "block_size", "topk", "doc_lengths", "seed", "layout")
GRIDS = {  # as benchmarks/attention.py: B*T = tokens (B = 1 past it), nh*hs = width
    "full": {"head_dims": [64, 128], "tokens": 16384, "width": 2048},
    "quick": {"head_dims": [128], "tokens": 16384, "width": 2048},
    "toy": {"head_dims": [16], "tokens": 256, "width": 32},
}
# the masks: issue 5's sizes on a GPU, scaled down with the toy sequences
MASKS = {
    "gpu": {"window": 1024, "block_size": 512, "topk": 3, "doc_lengths": [100, 2000]},
    "toy": {"window": 16, "block_size": 16, "topk": 2, "doc_lengths": [5, 40]},
}


# ----------------------------------------------------------------------------------------------
# masks: document ids and the number of visible (query, key) pairs, which the FLOPs count


def packed_document_ids(B: int, T: int, lengths: list[int], seed: int, device) -> torch.Tensor:
    """(B, T) int32, non-decreasing per row: documents of random lengths in [lo, hi] packed end to end,
    the last one cut at T. The same (B, T, lengths, seed) always gives the same batch."""
    lo, hi = lengths
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        doc_lengths = torch.randint(lo, hi + 1, (T // lo + 1,), generator=gen)
        rows.append(torch.repeat_interleave(torch.arange(len(doc_lengths)), doc_lengths)[:T])
    return torch.stack(rows).to(device=device, dtype=torch.int32)


def visible_pairs(family: str, B: int, T: int, args, document_ids: torch.Tensor | None = None) -> int:
    """(query, key) pairs one head attends to over the batch: the useful work of a kernel that
    skips everything masked."""
    t = torch.arange(T, dtype=torch.int64)
    if family == "dense":
        per_query = t + 1
    elif family == "window":
        per_query = t.clamp(max=args.window) + 1
    elif family == "moba":  # the causal part of its own block + topk whole past blocks where it has them
        per_query = t % args.block_size + 1 + (t // args.block_size).clamp(max=args.topk) * args.block_size
    else:  # documents: a causal triangle per document
        lengths = torch.cat([torch.unique_consecutive(row, return_counts=True)[1] for row in document_ids.cpu()])
        return int((lengths * (lengths + 1) // 2).sum())
    return B * int(per_query.sum())


# ----------------------------------------------------------------------------------------------
# what is timed: fn(q, k, v, causal) -> out, as benchmarks/attention.measure calls it


def ours(family: str, args, document_ids):
    """The family through our public API on --backend (triton on CUDA)."""
    if family == "moba":
        return lambda q, k, v, causal: moba_attention(q, k, v, args.block_size, args.topk, backend=args.backend)
    rules = {"dense": {}, "window": {"window": (args.window, 0)}}.get(family)
    if rules is None:  # documents: the block mask of this batch, built once and untimed as Flex's is
        T = document_ids.shape[1]
        rules = {"block_mask": BlockMask.from_rules(T, T, causal=True, document_ids=document_ids)}
    return lambda q, k, v, causal: attention(q, k, v, causal=causal, backend=args.backend, **rules)


def flex_mask_mod(family: str, args, document_ids):
    """The family's mask as a FlexAttention mask_mod, the flex backend's (attention/reference/flex.py). It is elementwise, so
    it is a masks.py mask_fn too: the tests check it against dense_mask."""
    rules = {"window": {"window": (args.window, 0)}, "documents": {"document_ids": document_ids}}[family]
    return rules_mask_mod(causal=True, **rules)


def flex(family: str, args, document_ids, shape: Shape, device):
    """FlexAttention with the family's mask; its block mask is built here, untimed."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch = shape.B if family == "documents" else None  # None: one mask broadcast over the batch
    block_mask = create_block_mask(flex_mask_mod(family, args, document_ids), B=batch, H=None,
                                   Q_LEN=shape.T, KV_LEN=shape.T, device=device)
    run = compiled_flex()
    return lambda q, k, v, causal: run(q, k, v, block_mask=block_mask)


# ----------------------------------------------------------------------------------------------
# the run


def family_shapes(args) -> list[tuple[str, Shape]]:
    seq_lens = {f: args.seq_lens or SEQ_LENS[args.grid][f] for f in FAMILIES if f != "dense"}
    # dense is the yardstick: it runs at every T of the sparse families in this run (all, if none is)
    sparse = [f for f in args.families if f != "dense"] or list(seq_lens)
    seq_lens["dense"] = sorted({T for f in sparse for T in seq_lens[f]})
    cases = []
    for family in args.families:
        for hs in args.head_dims:
            for T in seq_lens[family]:
                B = args.batch or max(1, args.tokens // T)
                cases.append((family, Shape(B, args.width // hs, T, hs, causal=True, group="grid")))
    return cases


def measure_case(family: str, shape: Shape, todo: dict[str, list[str]], args, device, dtype) -> list[dict]:
    """Rows of one (family, shape): todo maps each implementation to the passes to measure."""
    ids = None
    if family == "documents":
        ids = packed_document_ids(shape.B, shape.T, args.doc_lengths, args.seed, device)
    pairs = visible_pairs(family, shape.B, shape.T, args, ids)
    rows, fns, cells_of = [], {}, {}
    for impl, passes in todo.items():
        try:
            fns[impl] = ours(family, args, ids) if impl == args.backend else flex(family, args, ids, shape, device)
        except Exception as e:  # noqa: BLE001 -- e.g. no FlexAttention in this torch, or its block mask out of memory
            cells_of[impl] = {p: failed_cell(e, device) for p in passes}
    cells_of |= measure(fns, shape, todo, dtype, device, args.rep_ms, args.rounds, args.layout)  # side by side
    for impl in todo:
        for pass_, cell in cells_of[impl].items():
            if cell["ms"] is not None:  # measure() counted dense causal FLOPs; count what the mask leaves
                flops = 4 * shape.nh * shape.hs * pairs * PASS_FLOP_FACTOR[pass_]
                cell["tflops"] = flops / (cell["ms"] * 1e-3) / 1e12
            rows.append({"backend": f"{family} {impl}", "family": family, **asdict(shape), "pass": pass_, **cell,
                         "visible_pairs": pairs,
                         "ms_per_sequence": cell["ms"] / shape.B if cell["ms"] is not None else None})
    return rows


def run(args) -> Path:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    out_dir = Path(args.out_dir or default_out_dir("sparse"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.json"
    settings = {
        "dtype": args.dtype,
        "backend": args.backend,
        "passes": args.passes,
        "window": [args.window, 0],
        "block_size": args.block_size,
        "topk": args.topk,
        "doc_lengths": args.doc_lengths,
        "seed": args.seed,
        "rep_ms": args.rep_ms,
        "rounds": args.rounds,
        "layout": args.layout,
        "timer": "triton.testing.do_bench median, CUDA events" if device.type == "cuda"
        else "time.perf_counter median on CPU (rough: no cache flush, no GPU)",
        "flops": "4*nh*hs per visible (query, key) pair (the mask's useful work), x2.5 backward, x3.5 forward+backward",
        "memory": "peak allocated during one fwd+bwd minus the allocated inputs q, k, v, dout (null on CPU)",
        "compile": "torch._dynamo.reset() before every shape, flex compiled with static shapes (compile time "
                   "excluded); flex's block mask built once per shape, untimed; ours: the window's on the first "
                   "call (then cached), the documents' once per shape from the batch's ids with "
                   "BlockMask.from_rules (as a model builds it once per batch for all layers), untimed",
    }
    env, rows = environment(device), []
    if args.resume and results_path.exists():
        earlier = json.loads(results_path.read_text())
        same_setup = [earlier["env"][k] for k in ("gpu", "torch", "triton")] == [env[k] for k in ("gpu", "torch", "triton")]
        same_masks = all(earlier["settings"].get(k) == settings[k] for k in CELL_SETTINGS)
        if not same_setup or not same_masks:
            raise SystemExit(f"{results_path} was measured on another setup or with other settings; use another --out_dir")
        rows = earlier["rows"]
    done = {(r["backend"], r["B"], r["nh"], r["T"], r["hs"], r["pass"]) for r in rows}
    results = {"env": env, "settings": settings, "rows": rows}

    cases = family_shapes(args)
    for family, shape in tqdm(cases, unit="shape"):
        impls = [args.backend] + (["flex"] if args.flex and family in FLEX_FAMILIES else [])
        todo = {i: [p for p in args.passes if (f"{family} {i}", shape.B, shape.nh, shape.T, shape.hs, p) not in done]
                for i in impls}
        todo = {i: passes for i, passes in todo.items() if passes}
        if todo:
            torch._dynamo.reset()  # see settings["compile"] and benchmarks/attention.py
            rows += measure_case(family, shape, todo, args, device, dtype)
            write_json(results_path, results)  # after every shape: a run cut off keeps what it measured
    write_report(out_dir)
    return out_dir


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--backend", help="our attention backend: default triton on cuda, naive on cpu")
    p.add_argument("--flex", action=argparse.BooleanOptionalAction, help="FlexAttention too (default on cuda only)")
    p.add_argument("--families", type=comma_list(str), default=list(FAMILIES), help=f"from {','.join(FAMILIES)}")
    p.add_argument("--passes", type=comma_list(str), default=["fwd", "fwd+bwd"], help="from fwd,bwd,fwd+bwd")
    p.add_argument("--grid", choices=list(GRIDS), help="size preset: default full on cuda, toy on cpu")
    p.add_argument("--quick", action="store_const", const="quick", dest="grid", help="same as --grid quick")
    p.add_argument("--seq_lens", type=comma_list(int), help="override every family's sequence lengths")
    p.add_argument("--head_dims", type=comma_list(int), help="override the grid's head dims")
    p.add_argument("--tokens", type=int, help="B*T of every shape while T <= tokens (default 16384)")
    p.add_argument("--width", type=int, help="nh*hs of every shape (default 2048)")
    p.add_argument("--batch", type=int, help="fix B instead of B*T")
    p.add_argument("--window", type=int, help="left size of the causal sliding window (default 1024)")
    p.add_argument("--block_size", type=int, help="MoBA block size (default 512)")
    p.add_argument("--topk", type=int, help="MoBA past blocks per query (default 3)")
    p.add_argument("--doc_lengths", type=comma_list(int), help="lo,hi document lengths (default 100,2000)")
    p.add_argument("--rep_ms", type=float, default=100.0, help="time spent timing each cell (do_bench's rep)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per shape, as benchmarks/attention.py's")
    p.add_argument("--layout", choices=["contiguous", "model"], default="contiguous",
                   help="q, k, v contiguous, or views of one (B, T, 3, nh, hs) tensor as a model's projection makes them")
    p.add_argument("--out_dir", help="default out/sparse/")
    p.add_argument("--resume", action="store_true", help="keep the cells already in out_dir/results.json")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    on_gpu = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    args.backend = args.backend or ("triton" if on_gpu else "naive")
    args.flex = on_gpu if args.flex is None else args.flex
    args.grid = args.grid or ("full" if on_gpu else "toy")
    for key, value in (GRIDS[args.grid] | MASKS["toy" if args.grid == "toy" else "gpu"]).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for what, given, allowed in (("family", args.families, FAMILIES), ("pass", args.passes, PASSES)):
        unknown = [x for x in given if x not in allowed]
        if unknown:
            p.error(f"unknown {what} {unknown[0]!r}; choose from {', '.join(allowed)}")
    if len(args.doc_lengths) != 2 or not 0 < args.doc_lengths[0] <= args.doc_lengths[1]:
        p.error(f"--doc_lengths takes lo,hi with 0 < lo <= hi, got {args.doc_lengths}")
    if any(args.width % hs for hs in args.head_dims):
        p.error(f"--width {args.width} must be a multiple of every head dim {args.head_dims}")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give at least 1")
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # the q, k, v of every cell
    out_dir = run(args)
    print(f"results in {out_dir}")
    return out_dir


if __name__ == "__main__":
    main()
