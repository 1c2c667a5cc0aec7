"""Decoding speed: GPT.generate() without the KV cache, with it, and with its decode step in a CUDA graph.

    python -m benchmarks.generate                                     # GPT-2 124M, random weights, sdpa, B=1 and 8
    python -m benchmarks.generate --backends sdpa,triton --init_from path/to/model.safetensors
    python -m benchmarks.generate --device cpu --model toy            # tiny model: for tests, not for numbers

Every cell (backend, B, mode) generates --new_tokens greedy tokens after a random prompt of --prompt_len
tokens. The modes: no cache (use_cache=False: the whole context every step), cache (the static decode
step run eagerly, cuda_graph=False) and, on CUDA only, cache+graph (the step captured once in a CUDA
graph and replayed per token; the capture happens inside every generate() call and is timed with it).
--warmup runs untimed (torch.compile, Triton's tuner and the allocator do their work there), then
--repeats timed runs. tokens/s = B * new_tokens / median wall time; the time includes the prompt's
forward and is taken between torch.cuda.synchronize() calls. With prompt_len + new_tokens past
block_size every mode re-runs the whole window every step from there on (see GPT.generate).

Writes results.json (environment, settings, one row per cell) and results.md, and prints the table.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python benchmarks/generate.py` works too

import torch

if not torch.cuda.is_available():
    # Triton reads this when it is imported: without a GPU our kernel can only run in its CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.attention import DTYPES, comma_list
from benchmarks.report import default_out_dir, environment, fmt, markdown_table, write_json
from model import GPT, GPTConfig
from pretrained import PRESET_ALIASES, PRESETS

TOY = dict(n_layer=2, n_head=2, n_embd=32)  # head dim 16, the smallest the Triton kernel takes


def build_model(args, backend: str, device: torch.device) -> GPT:
    torch.manual_seed(args.seed)  # the same random weights for every backend
    if args.init_from:
        model = GPT.from_pretrained(args.init_from, attn=backend)
    elif args.model == "toy":
        model = GPT(GPTConfig(**TOY, attn=backend))
    else:
        model = GPT(GPTConfig.preset(args.model, attn=backend))
    return model.to(device, DTYPES[args.dtype]).eval()


# mode name -> generate() keyword arguments; "cache+graph" only on CUDA
MODES = {
    "no cache": {"use_cache": False, "cuda_graph": False},
    "cache": {"use_cache": True, "cuda_graph": False},
    "cache+graph": {"use_cache": True, "cuda_graph": True},
}


def modes_for(device: torch.device) -> list[str]:
    return [mode for mode in MODES if device.type == "cuda" or not MODES[mode]["cuda_graph"]]


def timed_generate(model: GPT, prompt: torch.Tensor, new_tokens: int, mode: str) -> tuple[float, torch.Tensor]:
    if prompt.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(prompt, new_tokens, temperature=0, **MODES[mode])
    if prompt.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def measure(model: GPT, prompt: torch.Tensor, args) -> list[dict]:
    """One row per mode: median seconds and tokens/s over the timed runs."""
    rows, outputs = [], {}
    for mode in modes_for(prompt.device):
        for _ in range(args.warmup):
            timed_generate(model, prompt, args.new_tokens, mode)
        seconds = []
        for _ in range(args.repeats):
            elapsed, outputs[mode] = timed_generate(model, prompt, args.new_tokens, mode)
            seconds.append(elapsed)
        median = statistics.median(seconds)
        rows.append({"mode": mode, **MODES[mode], "median_s": median, "runs_s": seconds,
                     "tokens_per_s": prompt.size(0) * args.new_tokens / median})
    # greedy tokens agree with the uncached ones unless rounding in a low-precision dtype flips a
    # near-tie of the logits
    return [{**row, "same_tokens": torch.equal(outputs[row["mode"]], outputs["no cache"])} for row in rows]


def run(args) -> dict:
    device = torch.device(args.device)
    results = {
        "env": environment(device),
        "settings": {key: getattr(args, key) for key in
                     ("model", "init_from", "dtype", "prompt_len", "new_tokens", "warmup", "repeats", "seed")}
        | {"timer": "time.perf_counter around generate(), torch.cuda.synchronize() before and after; median of runs"},
        "rows": [],
    }
    out_dir = Path(args.out_dir or default_out_dir("decoding"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for backend in args.backends:
        model = build_model(args, backend, device)
        for B in args.batch_sizes:
            torch._dynamo.reset()  # the compile backend starts fresh per cell; its compiles fall in the warm-up
            prompt = torch.randint(0, model.config.vocab_size, (B, args.prompt_len), device=device,
                                   generator=torch.Generator(device).manual_seed(args.seed))
            for row in measure(model, prompt, args):
                results["rows"].append({"backend": backend, "B": B, **row})
                print(f"{backend} B={B} {row['mode']}: {row['tokens_per_s']:,.1f} tokens/s")
            write_json(out_dir / "results.json", results)  # after every cell: a run cut off keeps what it measured
        del model
    table = report(results)
    (out_dir / "results.md").write_text(table)
    print(table)
    print(f"results in {out_dir}")
    return results


def report(results: dict) -> str:
    """Markdown: tokens/s per mode and the speed-ups over no cache, per backend and batch size."""
    env, settings = results["env"], results["settings"]
    cells = {(r["backend"], r["B"], r["mode"]): r for r in results["rows"]}
    rows = []
    for backend, B in dict.fromkeys((r["backend"], r["B"]) for r in results["rows"]):
        measured = [cells.get((backend, B, mode)) for mode in MODES]  # no cache, cache, cache+graph (CUDA only)
        plain = measured[0]
        rows.append([backend, B,
                     *(fmt(r["tokens_per_s"]) if r else "-" for r in measured),
                     *(f"{fmt(r['tokens_per_s'] / plain['tokens_per_s'])}x" if r else "-" for r in measured[1:]),
                     " / ".join(("yes" if r["same_tokens"] else "no") if r else "-" for r in measured[1:])])
    title = (f"# generate(): tokens/s without the KV cache, with it, and with the decode step in a CUDA graph\n\n"
             f"{settings['init_from'] or settings['model']}, {settings['dtype']}, prompt {settings['prompt_len']} "
             f"tokens, {settings['new_tokens']} new tokens (greedy), median of {settings['repeats']} runs after "
             f"{settings['warmup']} warm-up; {env['gpu'] or env['device']}, torch {env['torch']}, "
             f"triton {env['triton']}, {env['date']}\n\n")
    header = ["backend", "B", "tokens/s, no cache", "tokens/s, cache", "tokens/s, cache+graph",
              "speed-up, cache", "speed-up, cache+graph", "same greedy tokens (cache / cache+graph)"]
    note = ("\nsame greedy tokens: the cached path generated the tokens of the uncached one. In bf16 or fp16 "
            "rounding can flip a near-tie of the logits, and random weights give near-uniform logits, so a 'no' "
            "there is no bug. '-': not measured (CUDA graphs need a CUDA device).\n")
    return title + markdown_table(header, rows) + note


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), help="weights and activations; default bf16 on cuda, fp32 on cpu")
    p.add_argument("--backends", type=comma_list(str), default=["sdpa"], help="comma-separated attention backends")
    p.add_argument("--model", default="gpt2", choices=[*PRESETS, *PRESET_ALIASES, "toy"],
                   help=f"random weights of a GPT-2 size, or toy ({TOY})")
    p.add_argument("--init_from", help="a local HF-layout GPT-2 state dict file instead (see GPT.from_pretrained)")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--batch_sizes", type=comma_list(int), default=[1, 8])
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per cell")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per cell")
    p.add_argument("--out_dir", help="default out/decoding/")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    for name in ("prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def main(argv=None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
