"""A Hugging Face model's training step with our attention against sdpa's: what a user of transformers gets.

A small random Llama (bf16, eager, grouped-query 16/4 heads of 128, 8 layers) built from its config, trained with
attn_implementation="sdpa" and with ours (attention/integrations/transformers.py), in one process, rounds rotating,
medians; ours twice (an A/A pair: the run's own noise).

    python -m benchmarks.hf_step                        # B=4 T=2048 and B=1 T=8192
    python -m benchmarks.hf_step --out_dir DIR          # also DIR/results.json and DIR/results.md
"""
import argparse
import statistics
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from attention.flash.native import wait as native_launcher_built
from attention.integrations.transformers import register
from benchmarks.report import rotations, write_results

SHAPES = [(4, 2048), (1, 8192)]  # (batch, tokens per row)


def model_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=8192)


def train_step(model, optimizer, ids):
    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def step_ms(step, steps: int) -> float:
    """Milliseconds per step over `steps` steps, timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def measure(rounds: int, steps: int) -> list[dict]:
    ours = register("triton")
    variants = {"sdpa": "sdpa", "triton": ours, "triton-again": ours}
    rows = []
    for B, T in SHAPES:
        torch.manual_seed(0)
        model = LlamaForCausalLM(model_config()).to("cuda", torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        ids = torch.randint(0, model.config.vocab_size, (B, T), device="cuda")
        steps_of = {}
        for name, implementation in variants.items():
            model.set_attn_implementation(implementation)
            steps_of[name] = train_step(model, optimizer, ids)
            for _ in range(3):  # warm: compiles, tunes, allocator pools
                steps_of[name]()
        native_launcher_built()  # (built in the background from the first eager call) so every timed step has it
        times = {name: [] for name in variants}
        for names in rotations(list(variants), rounds):
            for name in names:
                model.set_attn_implementation(variants[name])
                times[name].append(step_ms(steps_of[name], steps))
        for name, ms in times.items():
            rows.append(dict(B=B, T=T, backend=name, step_ms=statistics.median(ms), rounds_ms=ms))
        del model, optimizer
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| B x T | sdpa ms | triton ms | triton-again ms | sdpa / triton |", "|---|---|---|---|---|"]
    for B, T in SHAPES:
        ms = {r["backend"]: r["step_ms"] for r in rows if (r["B"], r["T"]) == (B, T)}
        lines.append(f"| {B} x {T} | {ms['sdpa']:.1f} | {ms['triton']:.1f} | {ms['triton-again']:.1f} | "
                     f"{ms['sdpa'] / ms['triton']:.3f}x |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    p.add_argument("--out_dir", default=None)
    args = p.parse_args(argv)
    rows = measure(args.rounds, args.steps)
    text = (f"{torch.cuda.get_device_name()}: Llama (8 layers, 16/4 heads of 128, bf16, eager) train step, medians of "
            f"{args.rounds} rotating rounds of {args.steps} steps\n\n{table(rows)}")
    print(text)
    if args.out_dir:
        write_results(args.out_dir, rows, text)


if __name__ == "__main__":
    main()
