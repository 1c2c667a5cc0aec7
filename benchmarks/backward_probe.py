"""Hopper backward variants side by side, as docs/perf_notes.md's probes measure them: each checked variant's every
tile against float64 on odd shapes (dq, dk, dv within 2x math attention's error + 1e-5, the tests' criterion), then
every variant's every tile timed beside cuDNN's backward on the grid's cells, in rotating rounds (a kernel runs at the
clock the one before it left under the H200's power cap, so a fixed order would favour the first), do_bench median.

A variant is a module with triton_hopper_backward's `TILES` and `backward`: NAME=dotted.module (importable, e.g.
attention.triton_hopper_backward, or HEAD's copy from `git archive HEAD attention` unpacked as attention_base) or
NAME=path/to/file.py (a copy of the module with absolute imports). Names marked with a trailing `!` are checked.

    python -m benchmarks.backward_probe --head_dim 128 --out_dir out/probe \\
        base=attention_base.triton_hopper_backward 'package!=attention.triton_hopper_backward'

Writes checks.json, times.jsonl and table.txt (cuDNN's time over each tile's, and each variant's best) under
--out_dir, and prints the table. Needs a Hopper GPU and Triton >= 3.6.
"""
import argparse
import datetime
import importlib
import importlib.util
import json
import statistics
from pathlib import Path

import torch

# odd shapes for the float64 checks: (B, Hq, Hkv, Tq, Tk, causal): GQA, Tq != Tk, ragged tiles, MQA
CHECK_SHAPES = [(2, 4, 4, 1000, 1000, True), (2, 4, 2, 300, 1000, True), (1, 4, 1, 777, 777, False),
                (2, 8, 2, 1000, 1000, False), (1, 3, 3, 1100, 1300, True)]


def grid_cells(head_dim: int) -> list[tuple[int, int, int, int, bool]]:
    """(B, H, T, D, causal): the grid's cells of this head dim (16k tokens, width 2048), and GPT-2's at hs=64."""
    cells = [(16384 // T, 2048 // head_dim, T, head_dim, causal)
             for causal in (True, False) for T in (1024, 4096, 16384)]
    return [(16, 12, 1024, 64, True)] * (head_dim == 64) + cells


def load(spec: str):
    """NAME[!]=dotted.module or NAME[!]=file.py -> (name, module, checked)."""
    name, _, where = spec.partition("=")
    checked = name.endswith("!")
    name = name.rstrip("!")
    if where.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(f"probe_{name}", where)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return name, module, checked


def inputs(B, Hq, Hkv, Tq, Tk, D, causal):
    """Fresh random bf16 q, k, v, dO and the forward's o, lse (seeded: every variant sees the same)."""
    from attention import triton_flash

    torch.manual_seed(0)
    q = torch.randn(B, Hq, Tq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, Tk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    o, lse = triton_flash.forward(q, k, v, causal, D ** -0.5)
    return q, k, v, do, o, lse


def check(variants: dict, head_dim: int) -> list[dict]:
    """Each variant's every tile against float64 math attention on CHECK_SHAPES."""
    import torch.nn.functional as F

    checks = []
    for B, Hq, Hkv, Tq, Tk, causal in CHECK_SHAPES:
        q, k, v, do, o, lse = inputs(B, Hq, Hkv, Tq, Tk, head_dim, causal)
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device="cuda").tril(Tk - Tq) if causal else None

        def math_grads(dtype):
            leaves = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
            qm, km, vm = leaves
            out = F.scaled_dot_product_attention(qm, km.repeat_interleave(Hq // Hkv, 1),
                                                 vm.repeat_interleave(Hq // Hkv, 1), attn_mask=mask)
            return torch.autograd.grad(out, leaves, do.to(dtype))
        exact, math = math_grads(torch.float64), math_grads(q.dtype)
        for name, module in variants.items():
            for tile in module.TILES[head_dim]:
                grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
                module.backward(do, q, k, v, o, lse, *grads, causal, head_dim ** -0.5, tile)
                for grad, ours, ex, m in zip(("dq", "dk", "dv"), grads, exact, math):
                    err = (ours.double() - ex).abs().max().item()
                    bound = 2 * (m.double() - ex).abs().max().item() + 1e-5
                    checks.append(dict(variant=name, shape=(B, Hq, Hkv, Tq, Tk, head_dim, causal), tile=tile,
                                       grad=grad, err=err, bound=bound, ok=err <= bound))
    return checks


def time_cells(variants: dict, head_dim: int, rounds: int = 3, rep_ms: float = 100.0) -> list[dict]:
    """Every variant's every tile (the main kernel and its pre- and post-pass, as a call runs them) beside cuDNN's
    backward, per grid cell: the median of `rounds` do_bench medians."""
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.attention import rotations

    rows = []
    for B, H, T, D, causal in grid_cells(head_dim):
        q, k, v, do, o, lse = inputs(B, H, H, T, T, D, causal)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=causal)
        runs = {"cudnn": lambda: torch.autograd.grad(out, (qc, kc, vc), do, retain_graph=True)}
        for name, module in variants.items():
            for tile in module.TILES[D]:
                launched = module.backward(do, q, k, v, o, lse, *grads, causal, D ** -0.5, tile)
                runs[f"{name}{tile}"] = lambda launched=launched: launched.again(do, q, k, v, o, lse, *grads, D ** -0.5)
        times = {name: [] for name in runs}
        for order in rotations(list(runs), rounds):
            for name in order:
                times[name].append(triton.testing.do_bench(runs[name], rep=rep_ms, return_mode="median"))
        for name, ts in times.items():
            rows.append(dict(B=B, H=H, T=T, D=D, causal=causal, name=name, ms=statistics.median(ts), rounds_ms=ts))
    return rows


def table(rows: list[dict], variants: list[str]) -> str:
    """Per cell: cuDNN's time over each tile's, then over each variant's best tile (above 1: faster than cuDNN)."""
    cells = list(dict.fromkeys((r["B"], r["H"], r["T"], r["D"], r["causal"]) for r in rows))
    tiles = [r["name"] for r in rows if (r["B"], r["H"], r["T"], r["D"], r["causal"]) == cells[0]]
    tiles.remove("cudnn")
    lines = ["cell | " + " | ".join(tiles) + " | best " + " | best ".join(variants)
             + " (cuDNN's backward time / ours)"]
    for B, H, T, D, causal in cells:
        ms = {r["name"]: r["ms"] for r in rows if (r["B"], r["H"], r["T"], r["D"], r["causal"]) == (B, H, T, D, causal)}
        best = [min(ms[tile] for tile in tiles if tile.split("(")[0] == name) for name in variants]
        lines.append(f"B{B} H{H} T{T} hs{D} {'causal' if causal else 'full'} | "
                     + " | ".join(f"{ms['cudnn'] / ms[tile]:.3f}" for tile in tiles) + " | "
                     + " | ".join(f"{ms['cudnn'] / t:.3f}" for t in best))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="+", help="NAME=dotted.module or NAME=file.py; NAME! to check it too")
    p.add_argument("--head_dim", type=int, choices=(64, 128), required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out_dir", type=Path, required=True)
    args = p.parse_args(argv)
    loaded = [load(spec) for spec in args.variants]
    variants = {name: module for name, module, _ in loaded}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                variants=dict(zip(variants, args.variants)))
    checks = check({name: module for name, module, checked in loaded if checked}, args.head_dim)
    (args.out_dir / "checks.json").write_text(json.dumps(dict(meta=meta, checks=checks), indent=1) + "\n")
    rows = time_cells(variants, args.head_dim, args.rounds)
    (args.out_dir / "times.jsonl").write_text("".join(json.dumps(row | meta) + "\n" for row in rows))
    text = (f"float64 checks: {sum(c['ok'] for c in checks)} of {len(checks)} passed\n"
            + table(rows, list(variants)) + "\n")
    (args.out_dir / "table.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
