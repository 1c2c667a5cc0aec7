"""Train GPT-2 with any attention backend.

    python train.py configs/smoke_cpu.py                          # seconds, on a CPU
    python train.py configs/shakespeare.py --attn=triton          # one GPU
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m_fineweb.py
    python train.py configs/shakespeare.py --resume               # continue out_dir/ckpt.pt

Every setting, with its default, is a field of TrainConfig (training/config.py); docs/training.md
explains them, the checkpoints and the metrics.jsonl format.
"""
import math
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, replace

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from data.loader import TokenLoader
from data.tokenizer import EOT_TOKEN, get_encoding
from model import GPT, GPTConfig
from training.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from training.config import ConfigError, TrainConfig, parse_args
from training.distributed import (World, close_process_group, gather_to_main, init_process_group,
                                  sum_across_ranks, wait_for_all_ranks, world_from_env)
from training.logger import RunLogger, format_step, peak_flops

CHECKPOINT_NAME = "ckpt.pt"
# The first steps of every process include torch.compile and CUDA warm-up; their records carry
# "warmup": true so that timing comparisons can leave them out.
TIMING_WARMUP_STEPS = 3


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to learning_rate over warmup_steps, then a cosine down to min_lr at decay_steps."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps  # +1: step 0 must not have lr 0
    if step >= cfg.decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / (cfg.decay_steps - cfg.warmup_steps)  # 0 -> 1
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def pick_device(cfg: TrainConfig, world: World) -> torch.device:
    name = cfg.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={cfg.device!r} but torch sees no CUDA GPU; pass --device=cpu")
    if name == "cuda" or (name.startswith("cuda") and "RANK" in os.environ):
        name = f"cuda:{world.local_rank}"  # under torchrun each process drives the GPU of its local rank
    return torch.device(name)


def pick_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    name = cfg.dtype
    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported()
    if name == "auto":
        # fp32 on CPU: autocast there is slow and lossy, and the CPU runs are tests and smoke runs
        name = "float32" if device.type == "cpu" else "bfloat16" if bf16_ok else "float16"
    if name == "bfloat16" and not bf16_ok:
        raise ConfigError(f"{torch.cuda.get_device_name(device)} has no bfloat16; pass --dtype=float16")
    return getattr(torch, name)


def set_tf32(cfg: TrainConfig, device: torch.device) -> None:
    """TF32 for the float32 matmuls and convolutions that remain (tf32=true), or exact float32 (tf32=false)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = cfg.tf32


class StopSignal:
    """SIGINT/SIGTERM only set a flag: the loop finishes its step, saves and exits cleanly.
    Stopping inside the handler could land in the middle of optimizer.step() and save weights
    that are half updated. A second signal gets the usual behaviour, so Ctrl-C twice still kills."""

    def __enter__(self):
        self.signum = None
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self.previous[signum])

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def build_model(cfg: TrainConfig, checkpoint: dict | None) -> GPT:
    if checkpoint:
        # the shape comes from the checkpoint; the backend and dropout may change between runs, but
        # another window or MoBA setting would be another model
        saved = GPTConfig(**checkpoint["model_config"])
        config = replace(saved, **cfg.attention_settings(), dropout=cfg.dropout)
        if config.sparsity() != saved.sparsity():
            flags = {"attn": saved.attn, "window": saved.window, **saved.sparsity()}
            raise ConfigError(f"the checkpoint's model has sparse attention {saved.sparsity() or 'none'} but this run "
                              f"asks for {config.sparsity() or 'none'}; resume with the settings that trained it: "
                              + " ".join(f"--{k}={v}" for k, v in flags.items()))
        model = GPT(config)
        model.load_state_dict(checkpoint["model"])
    elif cfg.init_from != "scratch":
        try:
            model = GPT.from_pretrained(cfg.init_from, **cfg.attention_settings())
        except ValueError as err:
            raise ConfigError(f"init_from: {err}") from None
    else:
        model = GPT(cfg.gpt_config())
    if cfg.block_size > model.config.block_size:
        raise ConfigError(f"block_size={cfg.block_size} is longer than the model's context of "
                          f"{model.config.block_size} positions; pass --block_size={model.config.block_size} or less")
    return model


def open_loader(cfg: TrainConfig, split: str, world: World) -> TokenLoader:
    try:
        return TokenLoader(cfg.data_dir, split, cfg.batch_size, cfg.block_size, world.rank, world.size)
    except (FileNotFoundError, ValueError) as err:
        hint = "; or pass --eval_interval=0 to train without evaluation" if split == "val" else ""
        raise ConfigError(f"{err}{hint}") from None


def prompt_tokens(cfg: TrainConfig, vocab_size: int) -> list[int]:
    try:
        ids = get_encoding().encode(cfg.sample_prompt, allowed_special="all") or [EOT_TOKEN]
    except RuntimeError as err:  # no BPE files offline
        raise ConfigError(f"{err}; or pass --sample_interval=0 to train without text samples") from None
    if max(ids) >= vocab_size:
        raise ConfigError(f"sample_prompt={cfg.sample_prompt!r} holds token ids >= vocab_size={vocab_size}; "
                          "pass --sample_interval=0 or a prompt within the vocabulary")
    return ids


@torch.no_grad()
def evaluate(model, loader: TokenLoader, start: dict, cfg: TrainConfig, autocast, device, world: World) -> float:
    """Mean loss over eval_iters val batches per rank. The loader rewinds to the same start every
    time, so each evaluation sees the same tokens and the val curve measures the model alone."""
    model.eval()
    loader.load_state_dict(start)
    total = torch.zeros((), device=device)
    for _ in range(cfg.eval_iters):
        x, y = loader.next_batch()
        with autocast:
            _, loss = model(x.to(device), y.to(device))
        total += loss.float()
    model.train()
    return sum_across_ranks(total).item() / (cfg.eval_iters * world.size)


def sample_text(model: GPT, prompt: list[int], cfg: TrainConfig, step: int, autocast, device) -> str:
    # Sampling draws from the global RNG; forking it keeps training's random stream, and so a
    # resumed run, the same whether or not samples were taken. The uncompiled model is used on
    # purpose: every new length would make a compiled one recompile.
    with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed + step)
        model.eval()
        with autocast:
            out = model.generate(torch.tensor([prompt], device=device), cfg.sample_tokens, top_k=200)
        model.train()
    enc = get_encoding()
    return enc.decode([t for t in out[0].tolist() if t < enc.n_vocab])  # padded-vocab ids have no text


def train(cfg: TrainConfig) -> None:
    world = world_from_env()
    device = pick_device(cfg, world)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group, so NCCL binds to this GPU
    init_process_group(world, device)
    try:
        run(cfg, world, device)
        # rank 0 is still writing the checkpoint; gloo can abort a rank that tears the group down
        # while another still uses it, so all leave together (not after an error: that would hang)
        wait_for_all_ranks()
    finally:
        close_process_group()


def run(cfg: TrainConfig, world: World, device: torch.device) -> None:
    # a different seed per rank gives each its own dropout masks; DDP copies rank 0's initial weights to all
    for seed_fn in (random.seed, np.random.seed, torch.manual_seed):
        seed_fn(cfg.seed + world.rank)
    set_tf32(cfg, device)
    dtype = pick_dtype(cfg, device)
    autocast = nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    grad_accum = cfg.grad_accum_steps(world.size)
    tokens_per_step = cfg.batch_size * cfg.block_size * grad_accum * world.size
    ckpt_path = os.path.join(cfg.out_dir, CHECKPOINT_NAME)

    checkpoint = None
    if cfg.resume:
        try:
            checkpoint = load_checkpoint(ckpt_path)
        except FileNotFoundError as err:
            raise ConfigError(str(err)) from None
    start_step = checkpoint["step"] if checkpoint else 0

    raw_model = build_model(cfg, checkpoint).to(device)
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device.type)
    # loss scaling keeps small fp16 gradients from flushing to zero; bf16 and fp32 do not need it
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    train_loader = open_loader(cfg, "train", world)
    val_loader = open_loader(cfg, "val", world) if cfg.eval_interval else None
    val_start = val_loader.state_dict() if val_loader else None
    prompt = prompt_tokens(cfg, raw_model.config.vocab_size) if cfg.sample_interval and world.is_main else None
    best_val_loss = math.inf
    if checkpoint:
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        train_loader.load_state_dict(checkpoint["train_loader"])
        best_val_loss = checkpoint["best_val_loss"]
        if len(checkpoint["rng"]) == world.size:
            set_rng_state(checkpoint["rng"][world.rank])
        elif world.is_main:
            print(f"checkpoint was written by {len(checkpoint['rng'])} processes, this run has {world.size}: "
                  "random streams (dropout) start fresh; data order and weights continue exactly")

    model = torch.compile(raw_model) if cfg.compile else raw_model
    ddp = torch.distributed.is_initialized()
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    logger = RunLogger(cfg, start_step, checkpoint["wandb_run_id"] if checkpoint else None) if world.is_main else None
    flops_per_token = raw_model.flops_per_token()
    peak = peak_flops(device) if dtype != torch.float32 else None  # the table holds bf16/fp16 peaks
    if world.is_main:
        sparsity = "".join(f", {key}={value}" for key, value in raw_model.config.sparsity().items())
        print(f"{raw_model.num_params() / 1e6:.1f}M parameters, attn={cfg.attn}{sparsity}, {device}, {dtype}, "
              f"{world.size} process(es) x {grad_accum} micro-batch(es) of {cfg.batch_size}x{cfg.block_size} "
              f"= {tokens_per_step:,} tokens/step" + (f", resuming at step {start_step}" if checkpoint else ""))
    del checkpoint  # its CPU copy of the weights and optimizer state is no longer needed

    def save(step: int) -> None:
        rng = gather_to_main(rng_state())  # a collective: every rank takes part
        if world.is_main:
            save_checkpoint({
                # the unwrapped module: no DDP `module.` or torch.compile `_orig_mod.` key prefixes
                "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                "model_config": asdict(raw_model.config), "train_config": asdict(cfg),
                "step": step, "best_val_loss": best_val_loss, "train_loader": train_loader.state_dict(),
                "rng": rng, "wandb_run_id": logger.wandb_run_id,
            }, ckpt_path)

    def optimizer_step(lr: float, stop_requested: bool) -> tuple[float, torch.Tensor, float]:
        """One update over grad_accum micro-batches; returns the loss averaged over the whole batch and
        all ranks, the pre-clip gradient norm, and how many ranks were asked to stop."""
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(grad_accum):
            x, y = train_loader.next_batch()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # DDP all-reduces gradients in every backward: only the last micro-step's is needed
            last_micro = micro_step == grad_accum - 1
            with nullcontext() if last_micro or not ddp else model.no_sync():
                with autocast:
                    _, loss = model(x, y)
                loss_sum += loss.detach()
                scaler.scale(loss / grad_accum).backward()  # / grad_accum: the mean over the whole batch
        scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or math.inf)
        scaler.step(optimizer)
        scaler.update()
        # one all-reduce carries both the loss to log and the stop requests, so that all ranks stop
        # after the same step
        stop_flag = torch.tensor(float(stop_requested), device=device)
        shared = sum_across_ranks(torch.stack([loss_sum / grad_accum, stop_flag]))
        loss_total, stop_votes = shared.tolist()
        return loss_total / world.size, grad_norm, stop_votes

    # disable=None: a bar on a terminal; in a log file its redraws would bury the step lines
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=None if world.is_main else True, dynamic_ncols=True)
    step, stopped_by = start_step, None
    with StopSignal() as stop:
        while True:
            # step = optimizer updates done so far; val loss and samples describe the model after them
            last = step >= cfg.max_steps  # >=: a resume may start past a lowered max_steps
            if cfg.eval_interval and (step % cfg.eval_interval == 0 or last):
                val_loss = evaluate(model, val_loader, val_start, cfg, autocast, device, world)
                best_val_loss = min(best_val_loss, val_loss)
                if world.is_main:
                    logger.log_val(step, val_loss, cfg.attn)
                    bar.write(f"step {step}: val loss {val_loss:.4f}")
            if world.is_main and cfg.sample_interval and ((step and step % cfg.sample_interval == 0) or last):
                text = sample_text(raw_model, prompt, cfg, step, autocast, device)
                logger.log_sample(step, text)
                bar.write(f"step {step} sample:\n{text}")
            if last:
                break

            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            train_loss, grad_norm, stop_votes = optimizer_step(lr, stop.signum is not None)
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0

            tokens_per_s = tokens_per_step / step_s
            if world.is_main:
                bar.update(1)
                bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", ms=f"{1000 * step_s:.0f}",
                                tok_s=f"{tokens_per_s:,.0f}")
                if step % cfg.log_interval == 0 or step == cfg.max_steps - 1:
                    record = {
                        "step": step, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm.item(),
                        "step_ms": 1000 * step_s, "tokens_per_s": tokens_per_s,
                        "mfu": flops_per_token * tokens_per_s / (peak * world.size) if peak else None,
                        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
                        "attn": cfg.attn, "warmup": step - start_step < TIMING_WARMUP_STEPS,
                    }
                    logger.log_train(record)
                    bar.write(format_step(record, cfg.max_steps))
            step += 1
            if stop_votes:
                stopped_by = signal.Signals(stop.signum).name if stop.signum else "a signal to another rank"
                break
            if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0 and step < cfg.max_steps:
                save(step)

    save(step)
    bar.close()
    if world.is_main:
        logger.close()
        status = f"stopped by {stopped_by}" if stopped_by else "done"
        best = f"best val loss {best_val_loss:.4f}; " if best_val_loss < math.inf else ""
        resume_hint = "; continue with --resume" if stopped_by else ""
        print(f"{status} at step {step}; {best}checkpoint {ckpt_path}{resume_hint}")


def main(argv: list[str]) -> None:
    try:
        train(parse_args(argv))
    except ConfigError as err:
        sys.exit(f"train.py: error: {err}")


if __name__ == "__main__":
    main(sys.argv[1:])
