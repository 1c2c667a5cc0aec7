"""Train GPT-2 with any attention backend.

    python train.py configs/smoke_cpu.py                          # seconds, on a CPU
    python train.py configs/shakespeare.py --attn=triton          # one GPU
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m_fineweb.py
    torchrun --standalone --nproc_per_node=2 train.py configs/shakespeare.py --parallel=fsdp  # sharded
    python train.py configs/shakespeare.py --resume               # continue out_dir/ckpt.pt

Every setting, with its default, is a field of TrainConfig (training/config.py); docs/training.md
explains them, the checkpoints and the metrics.jsonl format.
"""
import gc
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, replace
from functools import partial

import numpy as np
import torch
from tqdm import tqdm

from data import shakespeare
from data.loader import TokenLoader
from data.shards import INDEX, ShardError
from data.tokenizer import EOT_TOKEN, get_encoding
from model import GPT, PRESET_ALIASES, PRESETS, GPTConfig
from training import warm_kernels
from training.checkpoint import CheckpointError, Checkpoints, rng_state, set_rng_state
from training.config import ConfigError, TrainConfig, parse_args
from training.distributed import (LostRankError, World, broadcast_from_main, close_process_group, data_parallel,
                                  fsdp_no_sync, full_state, gather_to_main, init_process_group, load_optimizer_state,
                                  local, lost_contact, shard, sum_across_ranks, wait_for_all_ranks, world_from_env)
from training.logger import RunLogger, format_skipped, format_step, peak_flops
from training.preflight import (check_attention_device, check_hub_reachable, check_out_dir, pick_device,
                                pick_dtype, set_tf32)
from training.step import TrainStep
from training.stop import Stopped, StopSignal

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


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


class NonFiniteError(RuntimeError):
    """Training met non-finite losses or gradients it may not go on with (TrainConfig.nonfinite)."""


def build_model(cfg: TrainConfig, checkpoint: dict | None) -> GPT:
    if checkpoint:
        # the shape comes from the checkpoint; the backend and dropout may change between runs, but
        # another window or a sparse backend's settings would be another model
        try:
            saved = GPTConfig(**checkpoint["model_config"])
        except (TypeError, ValueError) as err:
            raise ConfigError(f"the checkpoint's model_config does not describe a model of this version ({err}); "
                              "resume it with the version that wrote it, or start a new run") from None
        config = replace(saved, **cfg.attention_settings(), dropout=cfg.dropout)
        if config.sparsity() != saved.sparsity():
            flags = {"attn": saved.attn, "window": saved.window, **saved.sparsity()}
            raise ConfigError(f"the checkpoint's model has sparse attention {saved.sparsity() or 'none'} but this run "
                              f"asks for {config.sparsity() or 'none'}; resume with the settings that trained it: "
                              + " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}"
                                         for k, v in flags.items()))
        model = GPT(config)
        try:
            model.load_state_dict(checkpoint["model"])
        except RuntimeError as err:  # a state dict of another shape: one line of what differs, not torch's list
            reason = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line
                           or "Missing" in line or "Unexpected" in line), str(err).splitlines()[0])
            raise ConfigError(f"the checkpoint's weights do not fit its own model_config ({reason}); it was not "
                              "written by this trainer, or was changed after") from None
    elif cfg.init_from != "scratch":
        name = PRESET_ALIASES.get(cfg.init_from, cfg.init_from)
        if name in PRESETS:  # what can be checked before a download of up to 6 GB
            check_block_size(cfg, GPTConfig.preset(name).block_size)
            check_hub_reachable(name)
        try:
            model = GPT.from_pretrained(cfg.init_from, **cfg.attention_settings())
        except (ValueError, OSError, ImportError) as err:
            raise ConfigError(f"init_from: {' '.join(str(err).split())}") from None  # transformers' errors span lines
    else:
        model = GPT(cfg.gpt_config())
    check_block_size(cfg, model.config.block_size)
    return model


def check_block_size(cfg: TrainConfig, context: int) -> None:
    if cfg.block_size > context:
        raise ConfigError(f"block_size={cfg.block_size} is longer than the model's context of {context} positions; "
                          f"pass --block_size={context} or less")


def prepare_default_data(cfg: TrainConfig, world: World) -> None:
    """The default data set, tiny shakespeare, is prepared on first use from the repository's copy of the text."""
    if os.path.normpath(cfg.data_dir) != os.path.normpath(shakespeare.OUT_DIR) or \
            os.path.exists(os.path.join(cfg.data_dir, INDEX)):
        return
    if world.is_main:
        counts = shakespeare.prepare(shakespeare.read_text(shakespeare.TEXT), cfg.data_dir)
        print(f"first use: prepared tiny shakespeare ({shakespeare.summary(counts, cfg.data_dir)})")
    wait_for_all_ranks()  # the other ranks read what rank 0 wrote


def with_default_config(argv: list[str]) -> list[str]:
    """`python train.py` without a config file: configs/shakespeare.py (GPT-2 124M, the backends' comparison) on a
    GPU, configs/shakespeare_cpu.py (a small GPT that trains in about a minute) without one. Says which it took."""
    if any(not arg.startswith("--") for arg in argv):
        return argv
    device = next((arg.partition("=")[2] for arg in reversed(argv) if arg.startswith("--device=")), "auto")
    gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                          "shakespeare.py" if gpu else "shakespeare_cpu.py")
    if os.environ.get("RANK", "0") == "0":
        print(f"no config file given: {os.path.relpath(config)} ("
              + ("GPT-2 124M on tiny shakespeare, the backends' comparison setting)" if gpu else
                 "a 4-layer GPT on tiny shakespeare, about a minute on a CPU; with a GPU the default is GPT-2 124M)"))
    return [config, *argv]


def open_loader(cfg: TrainConfig, split: str, world: World, vocab_size: int) -> TokenLoader:
    try:
        # the train loader reads a whole optimizer step's micro-batches before it may move on to the next shard
        accumulation = cfg.grad_accum_steps(world.size) if split == "train" else 1
        return TokenLoader(cfg.data_dir, split, cfg.batch_size, cfg.block_size, world.rank, world.size, vocab_size,
                           accumulation)
    except (FileNotFoundError, ValueError) as err:
        hint = "; or pass --eval_interval=0 to train without evaluation" if split == "val" else ""
        raise ConfigError(f"{err}{hint}") from None


def prompt_tokens(cfg: TrainConfig, vocab_size: int) -> list[int]:
    ids = get_encoding().encode(cfg.sample_prompt, allowed_special="all") or [EOT_TOKEN]
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
    check_attention_device(cfg, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group, so NCCL binds to this GPU
    init_process_group(world, device, cfg.dist_timeout)
    try:
        with StopSignal(immediate=world.size == 1) as stop:
            run(cfg, world, device, stop)
        # FSDP2's sharded model outlives run() in reference cycles. Collected at interpreter exit instead, its tensors
        # can be released from a gloo worker thread while Python finalizes, which aborts the rank ("terminate called
        # without an active exception", PyTorch issue 190489): so they go now, while the interpreter is whole
        gc.collect()
        # rank 0 is still writing the checkpoint; gloo can abort a rank that tears the group down
        # while another still uses it, so all leave together (not after an error: that would hang)
        wait_for_all_ranks()
    except RuntimeError as err:
        raise lost_contact(err) or err
    finally:
        close_process_group()


def resume_state(checkpoint: dict, raw_model: GPT, optimizer, scaler, train_loader: TokenLoader, world: World,
                 sharded: bool) -> None:
    """The optimizer, loss scaler, data position and random streams where the checkpoint left them (the weights are
    build_model's), or a ConfigError saying the checkpoint does not fit this run."""
    try:
        load_optimizer_state(raw_model, optimizer, checkpoint["optimizer"], sharded)
        scaler.load_state_dict(checkpoint["scaler"])
        train_loader.load_state_dict(checkpoint["train_loader"])
    except ShardError:
        raise  # a damaged shard names itself
    except (ValueError, KeyError, IndexError, RuntimeError) as err:
        raise ConfigError(f"the checkpoint's optimizer or data state does not fit this run ({err}); resume with "
                          "the settings and data_dir that trained it") from None
    if len(checkpoint["rng"]) == world.size:
        set_rng_state(checkpoint["rng"][world.rank])
    elif world.is_main:
        print(f"checkpoint was written by {len(checkpoint['rng'])} processes, this run has {world.size}: "
              "random streams (dropout) start fresh; data order and weights continue exactly")


class SettledSteps:
    """The run's launched steps as their results are read, one step late (settle; training/step.py): the progress
    bar and the step records, the skipped steps (in all, and non-finite in a row), and a stop request from any rank
    (stopped_by, None until one comes)."""

    def __init__(self, cfg: TrainConfig, world: World, device: torch.device, logger: RunLogger | None,
                 start_step: int, skipped: int, tokens_per_step: int, mfu_per_token: float | None,
                 stop: StopSignal, checkpoints: Checkpoints):
        self.cfg, self.world, self.device, self.logger, self.start_step = cfg, world, device, logger, start_step
        self.tokens_per_step, self.mfu_per_token = tokens_per_step, mfu_per_token
        self.stop, self.checkpoints = stop, checkpoints
        # disable=None: a bar on a terminal; in a log file its redraws would bury the step lines
        self.bar = tqdm(total=cfg.max_steps, initial=start_step, disable=None if world.is_main else True,
                        dynamic_ncols=True)
        self.skipped, self.in_a_row, self.stopped_by = skipped, 0, None

    def settle(self, launched) -> None:
        """Read a launched step's results, log them; raise NonFiniteError after too many non-finite steps in a row,
        note a stop request from any rank."""
        cfg = self.cfg
        n, pending, launch_s = launched
        result = pending.wait()
        # the step's span on the GPU's stream (training/step.py); on the CPU, where a step runs as it is launched,
        # the launch's own wall time (not the time between two reads: the last step is read right after the one
        # before it)
        step_s = result.device_ms / 1000 if result.device_ms is not None else launch_s
        self.in_a_row = 0 if result.finite else self.in_a_row + 1
        self.skipped += not result.finite
        tokens_per_s = self.tokens_per_step / step_s
        if self.world.is_main:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{lr_at(n, cfg):.2e}", ms=f"{1000 * step_s:.0f}",
                                 tok_s=f"{tokens_per_s:,.0f}")
            if n % cfg.log_interval == 0 or n == cfg.max_steps - 1 or not result.finite:
                record = {  # a skipped step's non-finite loss or norm is written as null: metrics.jsonl stays JSON
                    "step": n, "train_loss": finite_or_none(result.loss), "lr": lr_at(n, cfg),
                    "grad_norm": finite_or_none(result.grad_norm),
                    "step_ms": 1000 * step_s, "tokens_per_s": tokens_per_s,
                    "mfu": self.mfu_per_token * tokens_per_s if self.mfu_per_token is not None else None,
                    "peak_mem_gb": (torch.cuda.max_memory_allocated(self.device) / 1e9 if self.device.type == "cuda"
                                    else None),
                    "attn": cfg.attn, "warmup": n - self.start_step < TIMING_WARMUP_STEPS,
                    "skipped": not result.finite, "skipped_steps": self.skipped,
                }
                self.logger.log_train(record)
                self.bar.write(format_skipped(n, result.loss, result.grad_norm, self.skipped, self.in_a_row, cfg)
                               if not result.finite else format_step(record, cfg.max_steps))
        if not result.finite and (cfg.nonfinite == "stop" or self.in_a_row >= cfg.max_skipped_steps):
            if self.world.is_main:
                self.logger.close()
            raise NonFiniteError(
                f"{self.in_a_row} step(s) in a row had a non-finite loss or gradient norm (the last at step {n}, "
                f"--nonfinite={cfg.nonfinite}); stopped without saving. Lower --learning_rate or check the data; "
                f"{self.checkpoints.where_to_resume()}")
        if result.stop_votes and self.stopped_by is None:
            self.stopped_by = self.stop.name if self.stop.signum else "a signal to another rank"


def run(cfg: TrainConfig, world: World, device: torch.device, stop: StopSignal) -> None:
    # a different seed per rank gives each its own dropout masks; DDP (and broadcast_from_main before FSDP2
    # shards the model) copies rank 0's initial weights to all
    for seed_fn in (random.seed, np.random.seed, torch.manual_seed):
        seed_fn(cfg.seed + world.rank)
    set_tf32(cfg, device)
    check_out_dir(cfg.out_dir)
    dtype = pick_dtype(cfg, device)
    # our Triton kernels compile in a helper while this process builds and traces the model (a fresh start's cost)
    warm_kernels.start(cfg.gpt_config(), cfg.batch_size, dtype, device, world.local_rank)
    autocast = nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    grad_accum = cfg.grad_accum_steps(world.size)
    tokens_per_step = cfg.batch_size * cfg.block_size * grad_accum * world.size
    checkpoints = Checkpoints(cfg.out_dir)

    checkpoint = checkpoints.load(log=print if world.is_main else lambda _: None) if cfg.resume else None
    start_step = checkpoint["step"] if checkpoint else 0

    raw_model = build_model(cfg, checkpoint).to(device)
    distributed = torch.distributed.is_initialized()
    sharded = distributed and cfg.parallel == "fsdp"
    if sharded:  # before the optimizer is built: it must hold the shards
        broadcast_from_main(raw_model)
        shard(raw_model)
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2))
    # loss scaling keeps small fp16 gradients from flushing to zero; bf16 and fp32 do not need it
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    vocab_size = raw_model.config.vocab_size
    prepare_default_data(cfg, world)
    train_loader = open_loader(cfg, "train", world, vocab_size)
    val_loader = open_loader(cfg, "val", world, vocab_size) if cfg.eval_interval else None
    val_start = val_loader.state_dict() if val_loader else None
    # a sharded model's forward is a collective: every rank samples (the same tokens), rank 0 logs them
    samples_here = world.is_main or sharded
    prompt = prompt_tokens(cfg, vocab_size) if cfg.sample_interval and samples_here else None
    if checkpoint:
        resume_state(checkpoint, raw_model, optimizer, scaler, train_loader, world, sharded)
    best_val_loss = checkpoint["best_val_loss"] if checkpoint else math.inf

    model = torch.compile(raw_model) if cfg.compile else raw_model
    no_sync = partial(fsdp_no_sync, raw_model) if sharded else None
    if distributed and not sharded:
        model = data_parallel(model, device, cfg.ddp_bucket_mb, cfg.ddp_reduce_dtype)
        no_sync = model.no_sync
    optimizer_step = TrainStep(model, raw_model.parameters(), optimizer, scaler, train_loader.next_batch, autocast,
                               device, grad_accum, cfg.grad_clip, world.size, no_sync, cfg.nonfinite != "off",
                               interruptible=stop.interruptible)
    stop.hold()  # the logger's files and the loop's state must stay whole: from here on, see StopSignal

    logger = (RunLogger(cfg, start_step, checkpoint["wandb_run_id"] if checkpoint else None, raw_model.num_params())
              if world.is_main else None)
    flops_per_token = raw_model.flops_per_token()
    peak = peak_flops(device) if dtype != torch.float32 else None  # the table holds bf16/fp16 peaks
    if world.is_main:
        sparsity = "".join(f", {key}={value}" for key, value in raw_model.config.sparsity().items())
        print(f"{raw_model.num_params() / 1e6:.1f}M parameters, attn={cfg.attn}{sparsity}, {device}, {dtype}, "
              + (f"parallel={cfg.parallel}, " if distributed else "") +
              f"{world.size} process(es) x {grad_accum} micro-batch(es) of {cfg.batch_size}x{cfg.block_size} "
              f"= {tokens_per_step:,} tokens/step" + (f", resuming at step {start_step}" if checkpoint else "")
              + f"; records in {cfg.out_dir}")
    skipped = checkpoint.get("skipped_steps", 0) if checkpoint else 0  # steps without an update, in all
    del checkpoint  # its CPU copy of the weights and optimizer state is no longer needed

    steps = SettledSteps(cfg, world, device, logger, start_step, skipped, tokens_per_step,
                         flops_per_token / (peak * world.size) if peak else None, stop, checkpoints)

    def save(step: int) -> None:
        # a non-finite weight never reaches a checkpoint: the last good one stays the newest. Each rank checks what
        # it holds (an FSDP2 shard) and the ranks add up their verdicts, so all raise alike
        finite = torch.stack([torch.isfinite(local(p)).all() for p in raw_model.parameters()]).all()
        if sum_across_ranks((~finite).float()).item():  # one host sync
            raise NonFiniteError(f"the weights hold non-finite values at step {step}, so nothing was saved; lower "
                                 f"--learning_rate or --grad_clip; {checkpoints.where_to_resume()}")
        rng = gather_to_main(rng_state())  # collectives: every rank takes part
        weights, optimizer_state = full_state(raw_model, optimizer, sharded)
        if world.is_main:
            checkpoints.save({
                # the unwrapped module: no DDP `module.` or torch.compile `_orig_mod.` key prefixes
                "model": weights, "optimizer": optimizer_state, "scaler": scaler.state_dict(),
                "model_config": asdict(raw_model.config), "train_config": asdict(cfg),
                "step": step, "best_val_loss": best_val_loss, "train_loader": train_loader.state_dict(),
                "rng": rng, "wandb_run_id": logger.wandb_run_id, "skipped_steps": steps.skipped,
            })

    # step: optimizer steps launched so far (updates and skipped ones). A launched step's loss and flags are read
    # (settled) after the next step is queued, so the GPU never waits for the host between steps (training/step.py);
    # evaluation, samples, checkpoints and the end settle it first, so they describe the model after `step` steps
    step, in_flight = start_step, None

    try:
        while True:
            rewind = train_loader.state_dict(), rng_state()  # where a step cut short by a signal goes back to
            # >=: a resume may start past a lowered max_steps
            last = step >= cfg.max_steps or steps.stopped_by is not None
            evaluate_now = cfg.eval_interval and (step % cfg.eval_interval == 0 or last) and steps.stopped_by is None
            sample_now = (samples_here and cfg.sample_interval and steps.stopped_by is None
                          and ((step and step % cfg.sample_interval == 0) or last))
            save_now = cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0 and start_step < step
            if in_flight and (last or evaluate_now or sample_now or save_now):
                in_flight, launched = None, in_flight
                steps.settle(launched)
                continue  # the settled step may have asked to stop: decide again
            if save_now and step < cfg.max_steps and steps.stopped_by is None:  # the step before was settled above
                save(step)
            if evaluate_now:
                with stop.interruptible():
                    val_loss = evaluate(model, val_loader, val_start, cfg, autocast, device, world)
                best_val_loss = min(best_val_loss, val_loss)
                if world.is_main:
                    logger.log_val(step, val_loss, cfg.attn)
                    steps.bar.write(f"step {step}: val loss {val_loss:.4f}")
            if sample_now:
                with stop.interruptible():
                    text = sample_text(raw_model, prompt, cfg, step, autocast, device)
                if world.is_main:
                    logger.log_sample(step, text)
                    steps.bar.write(f"step {step} sample:\n{text}")
            if last:
                break

            started = time.perf_counter()
            pending = optimizer_step(lr_at(step, cfg), stop.signum is not None)
            launched = (step, pending, time.perf_counter() - started)  # with the launch's wall time (settle)
            step += 1
            if in_flight:
                steps.settle(in_flight)
            in_flight = launched
    except Stopped:
        # a step cut short goes back to where it started: a resume reads its batches and draws its dropout again.
        # The step before it was launched whole (its update is queued): it counts, and its results are read
        train_loader.load_state_dict(rewind[0])
        set_rng_state(rewind[1])
        if in_flight:
            steps.settle(in_flight)
        steps.stopped_by = stop.name

    if cfg.final_checkpoint:
        save(step)
    steps.bar.close()
    if world.is_main:
        logger.close()
        status = f"stopped by {steps.stopped_by}" if steps.stopped_by else "done"
        best = f"best val loss {best_val_loss:.4f}; " if best_val_loss < math.inf else ""
        skips = f"{steps.skipped} step(s) skipped for non-finite values; " if steps.skipped else ""
        resume_hint = "; continue with --resume" if steps.stopped_by else ""
        if not cfg.final_checkpoint:
            saved, resume_hint = "no final checkpoint (final_checkpoint=false)", ""
        else:
            saved = f"checkpoint {checkpoints.newest}"
        print(f"{status} at step {step}; {best}{skips}{saved}{resume_hint}")


def main(argv: list[str]) -> None:
    try:
        train(parse_args(with_default_config(argv)))
    except (ConfigError, CheckpointError, ShardError, NonFiniteError, LostRankError) as err:
        sys.exit(f"train.py: error: {err}")
    except Stopped as stopped:
        sys.exit(f"train.py: stopped by {stopped} before the first step; nothing was saved")


if __name__ == "__main__":
    main(sys.argv[1:])
