"""Two checkouts of the repository side by side on one machine: did a change slow anything down?

Run the same benchmark in each (benchmarks/gpu_session.sh's `versions` stage: the checkout before the change travels
in .gpu_carry/before/), then compare. Each run times PyTorch's own kernels beside ours, and those did not change:
their before/after ratio is the A/A spread of the two runs. A cell slowed down only where ours moved by more than it.

    python -m benchmarks.versions kernels before/results.json after/results.json   # benchmarks/attention.py's grids
    python -m benchmarks.versions step before/results.json after/results.json      # benchmarks/train_step.py's
"""
import argparse
import json
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

OURS, REFERENCE = "triton", "sdpa-cudnn"


def kernel_rows(before: dict, after: dict) -> list[dict]:
    """-> per (shape, pass): our ms and the reference's, before and after, and after/before for each."""
    def cells(results):
        return {(r["B"], r["nh"], r["T"], r["hs"], r["causal"], r["pass"], r["backend"]): r["ms"]
                for r in results["rows"] if r.get("status") == "ok"}
    old, new = cells(before), cells(after)
    rows = []
    for *shape, backend in old:
        if backend != OURS or (*shape, REFERENCE) not in old or (*shape, backend) not in new:
            continue
        ours_old, ours_new = old[(*shape, OURS)], new[(*shape, OURS)]
        ref_old, ref_new = old[(*shape, REFERENCE)], new[(*shape, REFERENCE)]
        rows.append(dict(shape=dict(zip(("B", "nh", "T", "hs", "causal", "pass"), shape)), ours_ms=(ours_old, ours_new),
                         reference_ms=(ref_old, ref_new), ours_change=ours_new / ours_old,
                         reference_change=ref_new / ref_old))
    return rows


def step_rows(before: dict, after: dict) -> list[dict]:
    """-> per backend both runs timed: its median step ms before and after, and after/before."""
    old, new = before["backends"], after["backends"]
    return [dict(backend=name, ms=(old[name]["median_ms"], new[name]["median_ms"]),
                 change=new[name]["median_ms"] / old[name]["median_ms"]) for name in old if name in new]


def report(kind: str, before: dict, after: dict) -> str:
    if kind == "kernels":
        rows = kernel_rows(before, after)
        spread = max(abs(r["reference_change"] - 1) for r in rows)
        lines = [f"| B nh T hs causal pass | {OURS} ms before -> after | change | {REFERENCE} change (A/A) |",
                 "|---|---|---|---|"]
        for r in rows:
            s = r["shape"]
            lines.append(f"| {s['B']} {s['nh']} {s['T']} {s['hs']} {s['causal']} {s['pass']} | "
                         f"{r['ours_ms'][0]:.3f} -> {r['ours_ms'][1]:.3f} | {r['ours_change']:.3f} | "
                         f"{r['reference_change']:.3f} |")
        slower = [r for r in rows if r["ours_change"] - 1 > spread]
        lines.append(f"\nA/A spread (the reference's largest change): {spread:.1%}; cells of ours slower than that: "
                     f"{len(slower)} of {len(rows)}")
        return "\n".join(lines)
    rows = step_rows(before, after)
    lines = ["| backend | step ms before -> after | change |", "|---|---|---|"]
    lines += [f"| {r['backend']} | {r['ms'][0]:.2f} -> {r['ms'][1]:.2f} | {r['change']:.3f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=("kernels", "step"))
    p.add_argument("before")
    p.add_argument("after")
    args = p.parse_args(argv)
    print(report(args.kind, json.loads(Path(args.before).read_text()), json.loads(Path(args.after).read_text())))


if __name__ == "__main__":
    main()
