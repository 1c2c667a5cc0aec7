"""Table and plot of the terms benchmark (benchmarks/terms.py), made from its results.json alone so that they can
never drift from the measurements. Redraw a results folder with:

    python -m benchmarks.terms_report out/results/terms

Writes results.md: per term, its time over the plain kernel's and ours against the peer that computes the same term
(Flex for softcap and ALiBi, sdpa for dropout), each cell marked where it misses issue 47's target, the A/A pair's
ratio as the run's noise; and cost.png, the term / plain ratios as bars beside the cost target.
"""
import argparse
import json
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python benchmarks/<this file>` works too

from benchmarks.report import fmt, markdown_table, pyplot, save_png

# row label -> (our candidate, the peer's candidate or None, the peer's name)
TERMS = {
    "softcap": ("softcap", "flex-softcap", "Flex"),
    "ALiBi": ("alibi", "flex-alibi", "Flex"),
    "sinks": ("sinks", None, None),
    "dropout": ("dropout", "sdpa-dropout", "sdpa"),
    "return_lse": ("return_lse", None, None),
}
# issue 47's targets: a term's time / plain's at most this; ours at least this much faster than the peer's
COST_TARGET, DROPOUT_COST_TARGET = 1.10, 1.25
PEER_TARGET = {"softcap": 1.2, "ALiBi": 1.2, "dropout": 1.3}
MISS = "!"
SETTINGS = [(True, "fwd"), (True, "fwd+bwd"), (False, "fwd"), (False, "fwd+bwd")]


def setting_name(causal: bool, pass_: str) -> str:
    return f"{'causal' if causal else 'full'} {pass_}"


def load(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "results.json").read_text())


def times(results: dict) -> dict[tuple, float]:
    """(candidate, causal, pass) -> median ms, for the cells that were timed."""
    return {(c["candidate"], c["causal"], c["pass"]): c["ms"] for c in results["cells"] if c["ms"] is not None}


def ratio(ms: dict, top: str, bottom: str, setting: tuple) -> float | None:
    a, b = ms.get((top, *setting)), ms.get((bottom, *setting))
    return a / b if a is not None and b is not None else None


def cell(value: float | None, ok) -> str:
    """fmt(value), with MISS behind it where ok(value) fails (a missing value misses nothing: it shows '-')."""
    return fmt(value) + (MISS if value is not None and ok is not None and not ok(value) else "")


def table(results: dict) -> str:
    ms = times(results)
    settings = [s for s in SETTINGS if any((*s,) == (c["causal"], c["pass"]) for c in results["cells"])]
    header = (["term"] + [f"{setting_name(*s)}: term / plain" for s in settings] + ["peer"]
              + [f"{setting_name(*s)}: peer / ours" for s in settings])
    rows = []
    for label, (ours, peer, peer_name) in TERMS.items():
        most = DROPOUT_COST_TARGET if label == "dropout" else COST_TARGET
        least = PEER_TARGET.get(label)
        rows.append([label] + [cell(ratio(ms, ours, "plain", s), lambda x, m=most: x <= m) for s in settings]
                    + [peer_name or "-"]
                    + [cell(ratio(ms, peer, ours, s), lambda x, m=least: x >= m) if peer else "-" for s in settings])
    rows.append(["A/A: plain again (noise)"] + [fmt(ratio(ms, "plain-again", "plain", s)) for s in settings]
                + ["-"] + ["-"] * len(settings))
    for peer, peer_name in (("flex", "Flex"), ("sdpa", "sdpa")):
        rows.append(["plain (reference)"] + ["1"] * len(settings) + [peer_name]
                    + [fmt(ratio(ms, peer, "plain", s)) for s in settings])
    return markdown_table(header, rows)


def header_lines(results: dict) -> list[str]:
    env, args = results["env"], results["args"]
    where = env["gpu"] or env["device"]
    peers = ", ".join(f"{label} >= {x}x {TERMS[label][2]}'s" for label, x in PEER_TARGET.items())
    return [
        f"# What attention()'s terms cost: {where}, torch {env['torch']}, triton {env['triton']}, {env['date']}",
        "",
        f"B={args['batch']} H={args['heads']} T={args['seq_len']} hs={args['head_dim']} {args['dtype']}; "
        f"each cell the median over {args['rounds']} round(s), the order rotating; {results['settings']['timer']}.",
        f"Targets (issue 47): each term's time at most {COST_TARGET}x plain's ({DROPOUT_COST_TARGET}x for dropout); "
        f"ours faster than the peer computing the same term: {peers}. A cell that misses its target ends in "
        f"'{MISS}'; '-': not measured (see below). The A/A line, plain timed twice, is the run's own noise.",
        "",
    ]


def failures(results: dict) -> list[str]:
    return [f"- {c['candidate']} {setting_name(c['causal'], c['pass'])}: {c['status']}"
            for c in results["cells"] if c["ms"] is None]


def plot(results: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    ms = times(results)
    settings = [s for s in SETTINGS if any(key[1:] == s for key in ms)]
    labels = list(TERMS) + ["A/A"]
    candidates = [ours for ours, _, _ in TERMS.values()] + ["plain-again"]
    fig, ax = plt.subplots(figsize=(6, 2.8))
    width = 0.8 / max(len(settings), 1)
    for i, s in enumerate(settings):
        ys = [ratio(ms, c, "plain", s) or 0.0 for c in candidates]
        ax.bar([x + i * width for x in range(len(labels))], ys, width, label=setting_name(*s))
    ax.axhline(COST_TARGET, color="k", linestyle="--", linewidth=0.8, label=f"target {COST_TARGET}x (dropout "
                                                                                 f"{DROPOUT_COST_TARGET}x)")
    ax.set_xticks([x + width * (len(settings) - 1) / 2 for x in range(len(labels))], labels)
    ax.set_ylabel("time / plain's")
    ax.set_title(f"attention() terms, {results['env']['gpu'] or results['env']['device']}", fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))  # off the bars
    save_png(fig, path)
    return True


def write_report(out_dir) -> Path:
    out_dir = Path(out_dir)
    results = load(out_dir)
    lines = header_lines(results) + [table(results)]
    missing = failures(results)
    if missing:
        lines += ["Not measured:", ""] + missing + [""]
    if plot(results, out_dir / "cost.png"):
        lines += ["![term / plain](cost.png)", ""]
    (out_dir / "results.md").write_text("\n".join(lines))
    return out_dir / "results.md"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="a folder with the results.json of benchmarks/terms.py")
    path = write_report(p.parse_args(argv).out_dir)
    print(path.read_text())


if __name__ == "__main__":
    main()
