"""Probe: does the tuner pick, for each cell, the candidate that is fastest under sustained load? For each cell of
the benchmark grid and GPT-2's, the package's forward and backward are tuned (attention/triton_flash.py's tuner:
candidates in turns after a heating round); then every candidate is timed through the package with the choice
forced, in rounds in rotating order, beside cuDNN (do_bench, 100 ms each, median over rounds). HEAD's tuner's
choices come from head_choices.py, run before in a process of its own. bf16. One JSON line per (cell, pass,
candidate).

    PYTHONPATH=$PWD python3 benchmarks/results/2026-11-22-h200-tuner-under-load/tuner_audit.py OUT_DIR HEAD_CHOICES.json [HEAD_DIM]

With HEAD_DIM, only that head dim's cells.
"""
import datetime
import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import attention, triton_flash

sys.path.insert(0, "benchmarks/results/2026-11-22-h200-tuner-under-load")
from tuner_cells import CELLS  # noqa: E402

out_dir, head_choices = sys.argv[1], json.load(open(sys.argv[2]))
CELLS = [cell for cell in CELLS if len(sys.argv) < 4 or cell[3] == int(sys.argv[3])]
ROUNDS = 3
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def only_key(table, kernel=None):
    keys = [key for key in table if kernel is None or key[0] == kernel]
    assert len(keys) == 1, keys
    return keys[0]


triton_flash.tuning_log = []
rows = []
with open(f"{out_dir}/audit.jsonl", "w") as log:
    for B, H, T, D, causal in CELLS:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        for table in (triton_flash._best_tile, triton_flash._best_backward, triton_flash._plans):
            table.clear()  # each cell tuned afresh (GPT-2's cell and the hs=64 causal 1k cell share a tuning key)
        out = attention(q, k, v, causal=causal, backend="triton")  # tunes the forward
        torch.autograd.grad(out, (q, k, v), dout)  # tunes the backward
        fwd_key, bwd_key = only_key(triton_flash._best_tile, "fwd"), only_key(triton_flash._best_backward)
        fwd_log = next(e for e in reversed(triton_flash.tuning_log) if e["kernel"] == "fwd")
        bwd_log = next(e for e in reversed(triton_flash.tuning_log) if e["kernel"] == "bwd")
        tuned = {"fwd": triton_flash._best_tile[fwd_key], "bwd": triton_flash._best_backward[bwd_key]}
        out = attention(q, k, v, causal=causal, backend="triton")
        steps = {"fwd": lambda: attention(q, k, v, causal=causal, backend="triton"),
                 "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)}
        candidates = {"fwd": [c for c, t in fwd_log["times_ms"].items() if t != float("inf")],
                      "bwd": list(bwd_log["times_ms"])}
        tables = {"fwd": (triton_flash._best_tile, fwd_key), "bwd": (triton_flash._best_backward, bwd_key)}

        def forcing(pass_, choice):
            def force():
                table, key = tables[pass_]
                table[key] = choice
                triton_flash._plans.clear()
                steps[pass_]()  # the whole path with this choice: leaves its plan
            return force

        head_choice = head_choices[str((B, H, T, D, causal))]
        runs = []
        for pass_ in ("fwd", "bwd"):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn_out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            cudnn = {"fwd": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                     "bwd": lambda: torch.autograd.grad(cudnn_out, (q, k, v), dout, retain_graph=True)}[pass_]
            runs.append((pass_, "cudnn", lambda: None, cudnn))
            runs += [(pass_, choice, forcing(pass_, choice), steps[pass_]) for choice in candidates[pass_]]
        times = {(pass_, str(choice)): [] for pass_, choice, _, _ in runs}
        for r in range(ROUNDS):
            for pass_, choice, setup, fn in runs[r:] + runs[:r]:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    setup()
                    times[(pass_, str(choice))].append(triton.testing.do_bench(fn, rep=100, return_mode="median"))
        for pass_, choice, _, _ in runs:
            row = dict(B=B, H=H, T=T, D=D, causal=causal, pass_=pass_, candidate=str(choice),
                       ms=statistics.median(times[(pass_, str(choice))]), rounds_ms=times[(pass_, str(choice))],
                       tuner_choice=choice == tuned[pass_] and choice != "cudnn",
                       head_tuner_choice=str(choice) == head_choice[pass_],
                       new_tuner_ms=(fwd_log if pass_ == "fwd" else bwd_log)["times_ms"].get(choice),
                       **meta)
            rows.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
        del q, k, v, out, dout, cudnn_out

# the short table: cuDNN's time over the tuner's choice, over HEAD's tuner's choice, over the best under load
lines = ["cell pass | cudnn ms | new tuner: ratio (choice) | head tuner: ratio (choice) | best under load: ratio (candidate)"]
for B, H, T, D, causal in CELLS:
    for pass_ in ("fwd", "bwd"):
        cell = [r for r in rows if (r["B"], r["H"], r["T"], r["D"], r["causal"], r["pass_"]) == (B, H, T, D, causal, pass_)]
        cudnn = next(r["ms"] for r in cell if r["candidate"] == "cudnn")
        ours = [r for r in cell if r["candidate"] != "cudnn"]
        new = next(r for r in ours if r["tuner_choice"])
        head = next((r for r in ours if r["head_tuner_choice"]), dict(ms=float("nan"), candidate="not timed"))
        best = min(ours, key=lambda r: r["ms"])
        lines.append(f"B{B} H{H} T{T} hs{D} {'causal' if causal else 'full'} {pass_} | {cudnn:.4f} | "
                     f"{cudnn / new['ms']:.3f} ({new['candidate']}) | {cudnn / head['ms']:.3f} ({head['candidate']}) | "
                     f"{cudnn / best['ms']:.3f} ({best['candidate']})")
with open(f"{out_dir}/audit_table.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), file=sys.stderr)
