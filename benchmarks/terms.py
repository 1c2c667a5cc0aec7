"""What each of attention()'s terms costs over the plain kernel, and ours against the peers that compute the same
term (issue 47's speed table): softcap, ALiBi, sinks, dropout and return_lse through our triton backend, beside
the plain call twice (an A/A pair: the run's own noise), FlexAttention with the same softcap / ALiBi score_mod, and
sdpa with the same dropout; forward and forward+backward, causal and not, side by side in one process.

    python -m benchmarks.terms --out_dir out/results/terms       # B=4 H=16 T=4096 hs=128 bf16 -> results.json, .md
    python -m benchmarks.terms --causal true --passes fwd+bwd    # one column of the table
    python -m benchmarks.terms --candidates plain,softcap,flex-softcap
    python -m benchmarks.terms --device cpu                      # toy sizes, Triton's interpreter (tests)

results.json is rewritten after every timed cell; the table and plot are made from it alone
(benchmarks/terms_report.py, which can be re-run on its own).
"""
import argparse
import os
import statistics
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python benchmarks/terms.py`: see attention.py

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported, as in attention.py

import torch.nn.functional as F

from attention import attention
from benchmarks.attention import DTYPES, comma_list, failed_cell, median_ms, warm_up_gpu
from benchmarks.report import default_out_dir, environment, measured, parse_bool, rotations, write_json
from benchmarks.terms_report import write_report

PASSES = ("fwd", "fwd+bwd")
SOFTCAP, DROPOUT_P = 30.0, 0.1
# candidate -> (who computes it, the term it adds or None): ours is attention(backend="triton")
CANDIDATES = {
    "plain": ("ours", None),
    "plain-again": ("ours", None),
    "softcap": ("ours", "softcap"),
    "alibi": ("ours", "alibi"),
    "sinks": ("ours", "sinks"),
    "dropout": ("ours", "dropout"),
    "return_lse": ("ours", "return_lse"),
    "flex": ("flex", None),
    "flex-softcap": ("flex", "softcap"),
    "flex-alibi": ("flex", "alibi"),
    "sdpa": ("sdpa", None),
    "sdpa-dropout": ("sdpa", "dropout"),
}
SIZES = {  # B, H, T, hs: on a GPU 16k tokens a call, as benchmarks/attention.py's grid; on CPU a toy (interpreter)
    "cuda": dict(batch=4, heads=16, seq_len=4096, head_dim=128),
    "cpu": dict(batch=1, heads=2, seq_len=64, head_dim=16),
}


# ----------------------------------------------------------------------------------------------
# the candidates: make(H, T, causal, device) -> (call(q, k, v) -> out, the extra leaves fwd+bwd differentiates)


def alibi_slopes(H: int, device) -> torch.Tensor:
    """ALiBi's geometric slopes 2^(-8 (i+1) / H), float32 (H,)."""
    return torch.tensor([2 ** (-8 * (i + 1) / H) for i in range(H)], device=device)


def ours(term: str | None, H: int, T: int, causal: bool, device):
    sinks = torch.randn(H, device=device, requires_grad=True)
    kwargs = {None: {}, "softcap": {"softcap": SOFTCAP}, "alibi": {"alibi_slopes": alibi_slopes(H, device)},
              "sinks": {"sinks": sinks}, "dropout": {"dropout_p": DROPOUT_P}, "return_lse": {"return_lse": True}}[term]

    def call(q, k, v):
        out = attention(q, k, v, causal=causal, backend="triton", **kwargs)
        return out[0] if term == "return_lse" else out  # the lse is computed, not differentiated
    return call, (sinks,) if term == "sinks" else ()


def flex(term: str | None, H: int, T: int, causal: bool, device):
    """FlexAttention, its causal block mask built here (untimed). Compiled on CUDA; on CPU PyTorch's eager reference
    (compiling there takes longer than the whole toy run, and Flex has no backward on CPU either way)."""
    from torch.nn.attention.flex_attention import flex_attention

    from attention.reference.flex import causal_block_mask, compiled_flex, flex_score_mod

    block_mask = causal_block_mask(T, T, device) if causal else None
    # the project's score_mods: softcap * tanh(s / softcap), and s - slope[h] * |q_idx + Tk - Tq - kv_idx|
    score_mod = {None: None, "softcap": flex_score_mod(SOFTCAP, None, 0),
                 "alibi": flex_score_mod(0.0, alibi_slopes(H, device), 0)}[term]
    on_gpu = device.type == "cuda"
    run = compiled_flex() if on_gpu else flex_attention

    def call(q, k, v):
        if not on_gpu:
            q, k, v = q.detach(), k.detach(), v.detach()  # it refuses inputs that require grad on CPU
        return run(q, k, v, score_mod=score_mod, block_mask=block_mask)
    return call, ()


def sdpa(term: str | None, H: int, T: int, causal: bool, device):
    """F.scaled_dot_product_attention, PyTorch's pick of kernel for the call (with dropout too, as in training)."""
    p = DROPOUT_P if term == "dropout" else 0.0
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)), ()


MAKERS = {"ours": ours, "flex": flex, "sdpa": sdpa}


def skip_reason(name: str, pass_: str, device) -> str | None:
    if CANDIDATES[name][0] == "flex" and device.type != "cuda" and pass_ != "fwd":
        return "skipped: FlexAttention has no backward on CPU"
    return None


def step(call, leaves, pass_: str, dout):
    """The callable to time. The forward runs with autograd on, as in training; fwd+bwd differentiates q, k, v and the
    candidate's own leaves (sinks) with torch.autograd.grad, for benchmarks/attention.pass_step's reason."""
    q, k, v = leaves[:3]
    if pass_ == "fwd":
        return lambda: call(q, k, v)
    return lambda: torch.autograd.grad(call(q, k, v), leaves, dout)


# ----------------------------------------------------------------------------------------------
# the run


def measure(args, causal: bool, device, dtype, results: dict, save) -> None:
    """Every (candidate, pass) at one causal setting: each runs once first (compilation, autotuning), then
    `rounds` rounds time each once (median_ms), each round in an order of its own (report.rotations);
    results["cells"] gains a cell per (candidate, pass), save() after every timing."""
    B, H, T, D = args.batch, args.heads, args.seq_len, args.head_dim
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, T, D, device=device, dtype=dtype)
    cells, steps = {}, {}
    for name in args.candidates:
        who, term = CANDIDATES[name]
        for pass_ in args.passes:
            cell = cells[name, pass_] = {"candidate": name, "causal": causal, "pass": pass_, "ms_rounds": [],
                                         "ms": None, "status": "not run"}
            results["cells"].append(cell)
            try:
                reason = skip_reason(name, pass_, device)
                if reason:
                    cell["status"] = reason
                    continue
                call, extra = MAKERS[who](term, H, T, causal, device)
                steps[name, pass_] = step(call, (q, k, v, *extra), pass_, dout), (q, k, v, *extra)
                steps[name, pass_][0]()
            except Exception as e:  # a candidate that fails (Flex compile error, OOM) is a result, not a crash
                steps.pop((name, pass_), None)
                cell["status"] = failed_cell(e, device)["status"]
            save()
    for order in rotations(list(steps), args.rounds):
        for key in order:
            cell = cells[key]
            if cell["status"] not in ("not run", "ok"):  # failed in an earlier round
                continue
            try:
                cell["ms_rounds"].append(measured(median_ms(*steps[key], device, args.rep_ms)))
                cell.update(ms=statistics.median(cell["ms_rounds"]), status="ok")
            except Exception as e:
                cell.update(ms=None, status=failed_cell(e, device)["status"])
            save()


def run(args) -> Path:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    out_dir = Path(args.out_dir or default_out_dir("terms"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "env": environment(device),
        "settings": {
            "timer": "triton.testing.do_bench median, CUDA events" if device.type == "cuda"
            else "time.perf_counter median on CPU (rough: no cache flush, no GPU; Triton's interpreter)",
            "terms": {"softcap": SOFTCAP, "alibi": "slopes 2^(-8(i+1)/H)", "sinks": "randn (H,) fp32, differentiated",
                      "dropout": DROPOUT_P, "return_lse": "lse returned, not differentiated"},
            "flex": "torch.compile'd flex_attention, static shapes, causal block mask built once untimed"
            if device.type == "cuda" else "eager flex_attention (PyTorch's reference), forward only",
            "sdpa": "F.scaled_dot_product_attention, PyTorch's pick of kernel",
        },
        "args": vars(args),
        "cells": [],
    }

    def save():
        write_json(out_dir / "results.json", results)

    if device.type == "cuda":
        warm_up_gpu(device)
    for causal in args.causal:
        torch._dynamo.reset()  # Flex compiles each causal setting afresh, static, as a fixed-shape run does
        measure(args, causal, device, dtype, results, save)
    save()
    write_report(out_dir)
    return out_dir


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="default bf16 on cuda, fp16 on cpu (the interpreter gets bf16 tl.dot wrong)")
    p.add_argument("--batch", type=int, help="B (default 4 on cuda, 1 on cpu)")
    p.add_argument("--heads", type=int, help="H (default 16 on cuda, 2 on cpu)")
    p.add_argument("--seq_len", type=int, help="T (default 4096 on cuda, 64 on cpu)")
    p.add_argument("--head_dim", type=int, help="hs (default 128 on cuda, 16 on cpu)")
    p.add_argument("--causal", type=comma_list(parse_bool), default=[True, False], help="true,false (default both)")
    p.add_argument("--passes", type=comma_list(str), default=list(PASSES), help="comma-separated: fwd,fwd+bwd")
    p.add_argument("--candidates", type=comma_list(str), default=list(CANDIDATES),
                   help=f"comma-separated, from {','.join(CANDIDATES)}")
    p.add_argument("--rounds", type=int, help="rounds, the order rotating; a cell's ms is their median "
                                              "(default 9 on cuda, 1 on cpu)")
    p.add_argument("--rep_ms", type=float, help="time spent timing each cell in a round (default 100 on cuda; on "
                                                "cpu 1: three calls)")
    p.add_argument("--out_dir", help="default out/terms/")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    on_gpu = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bf16" if on_gpu else "fp16")
    for key, value in SIZES["cuda" if on_gpu else "cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.rounds = args.rounds or (9 if on_gpu else 1)
    args.rep_ms = args.rep_ms or (100.0 if on_gpu else 1.0)
    for what, given, allowed in (("candidate", args.candidates, CANDIDATES), ("pass", args.passes, PASSES)):
        unknown = [x for x in given if x not in allowed]
        if unknown:
            p.error(f"unknown {what} {unknown[0]!r}; choose from {', '.join(allowed)}")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give at least 1")
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # q, k, v, dout and the sinks
    out_dir = run(args)
    print(f"results in {out_dir}")
    return out_dir


if __name__ == "__main__":
    main()
