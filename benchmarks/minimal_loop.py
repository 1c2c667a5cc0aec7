"""The least a training step can be: forward, backward, clip, AdamW, nothing else. train.py's own
step (logging, metrics, signal checks, DDP hooks) should cost no more than a few percent on top.

    python -m benchmarks.minimal_loop configs/shakespeare.py --attn=sdpa --max_steps=50
    python train.py configs/shakespeare.py --attn=sdpa --max_steps=50 --wandb=false   # compare step_ms

It takes train.py's config files and flags, so both build the same model from the same batches
(model, attn, batch_size, block_size, total_batch_size, data_dir, compile, device, dtype, seed); the
rest (logging, eval, checkpoints) it ignores. No GradScaler: time it in bf16 or fp32, not fp16.
"""
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python benchmarks/minimal_loop.py` works too

import torch

from model import GPT
from train import TIMING_WARMUP_STEPS, open_loader, pick_device, pick_dtype
from training.config import ConfigError, parse_args
from training.distributed import World


def make_step(cfg, world: World, compile_mode: str = "default") -> tuple[Callable[[], None], torch.device, torch.dtype]:
    """-> (step, device, dtype): step() runs one training step (forward and backward over the
    gradient-accumulation micro-batches, clip, AdamW) of a model built from cfg, without syncing.
    compile_mode: torch.compile's mode when cfg.compile ("reduce-overhead" replays CUDA graphs)."""
    device = pick_device(cfg, world)
    dtype = pick_dtype(cfg, device)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    model = GPT(cfg.gpt_config()).to(device)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device.type)
    if cfg.compile:
        model = torch.compile(model, mode=compile_mode)
    loader = open_loader(cfg, "train", world)
    autocast = nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    grad_accum = cfg.grad_accum_steps(world.size)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for _ in range(grad_accum):
            x, y = loader.next_batch()
            with autocast:
                _, loss = model(x.to(device), y.to(device))
            (loss / grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
        optimizer.step()

    return step, device, dtype


def timed_steps(step: Callable[[], None], device: torch.device, n: int, wait_for_gpu: bool = True) -> list[float]:
    """ms of each of n steps, each timed from a synced GPU to a synced GPU; with wait_for_gpu=False only
    until step() returns, which is the host's time to issue the step's work."""
    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda" and wait_for_gpu:
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t0))
    return times


def main(argv: list[str]) -> float:
    """Runs max_steps steps and returns the median ms/step of those after the warm-up steps."""
    cfg = parse_args([*argv, "--wandb=false"])  # this loop logs nothing
    world = World()  # a single process
    step, device, dtype = make_step(cfg, world)
    step_ms = timed_steps(step, device, cfg.max_steps)
    timed = step_ms[TIMING_WARMUP_STEPS:] or step_ms  # the same warm-up steps train.py flags
    median_ms = statistics.median(timed)
    tokens = cfg.batch_size * cfg.block_size * cfg.grad_accum_steps(world.size)
    print(f"minimal loop, attn={cfg.attn}, B={cfg.batch_size}, T={cfg.block_size}, {device}, {dtype}: "
          f"median {median_ms:.1f} ms/step, {tokens / median_ms * 1000:,.0f} tok/s over {len(timed)} steps")
    return median_ms


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as err:
        sys.exit(f"minimal_loop: error: {err}")
