"""Train the Llama-style example (examples/llama.py) with any attention backend.

    python -m data.shakespeare                                     # once: the token shards
    python -m examples.train_llama --attn=triton --max_steps=300   # -> out/llama/triton/metrics.jsonl
    python -m examples.train_llama --attn=sdpa --max_steps=300 --compile
    python -m benchmarks.compare_report out/llama                  # table and loss plot of the runs
    python -m examples.train_llama --n_layer=4 --n_embd=128 --n_head=4 --block_size=256 --batch_size=4 \
        --max_steps=50 --warmup_steps=5                            # on a CPU: a small shape, about a minute

Flags are --key=value: every LlamaConfig field (model shape and --attn) and the training settings
in TRAIN_FLAGS, which keep train.py's defaults and checks (docs/training.md). One process, one
micro-batch per step; metrics.jsonl holds one line per step in train.py's format.
"""
import argparse
import sys
import time
from contextlib import nullcontext
from dataclasses import fields
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # `python examples/train_llama.py` works too

import torch

from benchmarks.report import environment, parse_bool, write_json
from data.loader import TokenLoader
from examples.llama import Llama, LlamaConfig
from train import TIMING_WARMUP_STEPS, lr_at
from training.config import ConfigError, TrainConfig
from training.distributed import World
from training.logger import RunLogger, format_step
from training.preflight import pick_device, pick_dtype

TRAIN_FLAGS = ("data_dir", "max_steps", "batch_size", "learning_rate", "min_lr", "warmup_steps",
               "weight_decay", "grad_clip", "seed", "device", "dtype", "compile")
PER_RUN_FLAGS = ("attn", "out_dir")  # what differs between the runs of one comparison


def parse_args(argv: list[str]) -> tuple[LlamaConfig, TrainConfig]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_fields = list(fields(LlamaConfig))
    for f in model_fields + [f for f in fields(TrainConfig) if f.name in TRAIN_FLAGS]:
        if f.type is bool:  # --compile alone, or --compile=true|false
            p.add_argument(f"--{f.name}", type=parse_bool, nargs="?", const=True, default=f.default)
        else:
            p.add_argument(f"--{f.name}", type=f.type, default=f.default, metavar=f.type.__name__.upper(),
                           help=f"default: {f.default}")
    p.add_argument("--out_dir", help="default: out/llama/<attn>, one folder per backend as compare_report reads them")
    args = vars(p.parse_args(argv))
    try:
        model_config = LlamaConfig(**{f.name: args[f.name] for f in model_fields})
    except ValueError as err:
        raise ConfigError(f"model: {err}") from None
    # TrainConfig checks the values and feeds train.py's helpers; what it holds beyond these flags
    # (GPT-2's shape, evaluation, sampling, wandb) this script does not use
    train_config = TrainConfig(**{name: args[name] for name in TRAIN_FLAGS}, block_size=model_config.block_size,
                               attn=model_config.attn, out_dir=args["out_dir"] or f"out/llama/{model_config.attn}",
                               wandb=False, sample_interval=0, eval_interval=0)
    return model_config, train_config


def train(model_config: LlamaConfig, cfg: TrainConfig, argv: list[str]) -> None:
    device = pick_device(cfg, World())
    dtype = pick_dtype(cfg, device)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    autocast = nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # fp16 gradients underflow unscaled

    model = Llama(model_config).to(device)
    optimizer = model.configure_optimizer(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                          fused=device.type == "cuda")
    step_model = torch.compile(model) if cfg.compile else model
    try:
        loader = TokenLoader(cfg.data_dir, "train", cfg.batch_size, cfg.block_size)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(str(err)) from None
    logger = RunLogger(cfg, 0, None)
    # run.json beside metrics.jsonl, as benchmarks/compare.py writes it: compare_report takes the
    # GPU and versions from it, and warns when runs of one folder differ in more than PER_RUN_FLAGS
    shared_args = [a for a in argv if a.lstrip("-").partition("=")[0] not in PER_RUN_FLAGS]
    write_json(Path(cfg.out_dir) / "run.json", {"backend": cfg.attn, "group": Path(cfg.out_dir).parent.name,
                                                "train_args": shared_args, "env": environment(device)})
    tokens_per_step = cfg.batch_size * cfg.block_size
    print(f"Llama {model.num_params() / 1e6:.1f}M parameters, attn={cfg.attn}, {device}, {dtype}, "
          f"{cfg.batch_size}x{cfg.block_size} = {tokens_per_step:,} tokens/step")

    for step in range(cfg.max_steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = (t.to(device, non_blocking=True) for t in loader.next_batch())
        with autocast:
            _, loss = step_model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        train_loss = loss.item()  # waits for the GPU, like the synchronize below
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        record = {
            "step": step, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm.item(),
            "step_ms": 1000 * step_s, "tokens_per_s": tokens_per_step / step_s, "mfu": None,
            "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
            "attn": cfg.attn, "warmup": step < TIMING_WARMUP_STEPS,  # compilation and warm-up: left out of timings
        }
        logger.log_train(record)
        print(format_step(record, cfg.max_steps))
    logger.close()
    print(f"done; metrics in {logger.metrics_path}")


def main(argv: list[str]) -> None:
    try:
        model_config, train_config = parse_args(argv)
        train(model_config, train_config, argv)
    except ConfigError as err:
        sys.exit(f"train_llama.py: error: {err}")


if __name__ == "__main__":
    main(sys.argv[1:])
