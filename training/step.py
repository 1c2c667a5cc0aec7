"""One optimizer step: forward and backward over the gradient-accumulation micro-batches, the gradient clipped, then
the update, unless the loss or the gradient norm came out non-finite. train.py runs it; benchmarks/train_step.py
times it (the non-finite check on and off, side by side).

The check adds no host sync: the ranks' non-finite flags go through the all-reduce that already carries the loss and
the stop requests, on the device, and the fused AdamW takes the result as its found_inf (the tensor a GradScaler
hands it): on a non-finite step the update kernel leaves the weights and moments as they are and takes its step
count back, without the host waiting for the flag. Every rank gets the same sum, so all skip or all step. The host
reads the flag after the update, with the loss, to count and log the skip. With an fp16 loss scaler the scaler skips
non-finite gradients itself (lowering the scale) and the check judges the loss alone, on the host, before the update.

A step returns as soon as its work is queued (LaunchedStep): its loss, flags and gradient norm travel to pinned host
memory behind that work, and wait() reads them once they land. train.py queues the next step before it waits on this
one, so the GPU never idles while the host logs and launches the next forward; a .item() or .tolist() here would
instead wait for everything queued, the next step included.
"""
import math
from contextlib import nullcontext
from typing import NamedTuple

import torch

from .distributed import local, sum_across_ranks


class StepResult(NamedTuple):
    loss: float  # mean over the batch and every rank
    grad_norm: float  # this rank's, before clipping
    stop_votes: float  # ranks asked to stop (SIGINT/SIGTERM)
    finite: bool  # False: the loss or gradient norm was not finite on some rank, and no update was made
    device_ms: float | None  # on a GPU, the step's span on its stream: from its first work to its results landing


class LaunchedStep:
    """A step whose work is queued on the device. values: [loss sum over ranks, stop votes, ranks not finite,
    this rank's grad norm]; they are copied to the host behind the step's work, and wait() blocks until they land.
    started: an event recorded (with timing) before the step's first work on a GPU, else None."""

    def __init__(self, values: torch.Tensor, world_size: int, started: torch.cuda.Event | None):
        self.world_size, self.started, self.landed = world_size, started, None
        if started is not None:
            self.values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.values.copy_(values, non_blocking=True)
            self.landed = torch.cuda.Event(enable_timing=True)
            self.landed.record()
        else:
            self.values = values

    def wait(self) -> StepResult:
        """The step's results, once they are on the host. Its time is the span between its two events on the stream,
        which a wall clock read when the host gets there cannot give: with the next step queued first, the host
        reaches a step late (the last one of a run, or after a slow log line) or early (while the GPU catches up)."""
        device_ms = None
        if self.landed is not None:
            self.landed.synchronize()
            device_ms = self.started.elapsed_time(self.landed)
        loss_total, stop_votes, ranks_not_finite, grad_norm = self.values.tolist()
        return StepResult(loss_total / self.world_size, grad_norm, stop_votes, ranks_not_finite == 0, device_ms)


class TrainStep:
    """step(lr, stop_requested) -> LaunchedStep (its wait() -> StepResult). model: what the batches run through
    (compiled, DDP-wrapped, sharded);
    no_sync(): the context that skips the gradient sync on all but the last micro-step (None: one process);
    params: the parameters to clip; optimizer: a fused one (AdamW(fused=True), which takes found_inf);
    batches(): the next (x, y) on the CPU. check_finite: skip the update on a non-finite loss or gradient norm.
    interruptible(): the context the forward and backward passes run in (training/stop.py's StopSignal stops a run
    there at once; never in the update)."""

    def __init__(self, model, params, optimizer, scaler, batches, autocast, device: torch.device, grad_accum: int,
                 grad_clip: float, world_size: int, no_sync, check_finite: bool, interruptible=nullcontext):
        if not optimizer.defaults.get("fused"):
            raise ValueError("TrainStep skips non-finite updates inside a fused optimizer; build it with fused=True")
        self.model, self.params, self.optimizer, self.scaler = model, list(params), optimizer, scaler
        self.batches, self.autocast, self.device = batches, autocast, device
        self.grad_accum, self.grad_clip, self.world_size = grad_accum, grad_clip or math.inf, world_size
        self.no_sync, self.check_finite, self.interruptible = no_sync, check_finite, interruptible

    def __call__(self, lr: float, stop_requested: bool) -> LaunchedStep:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        started = None
        if self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        with self.interruptible():
            for micro_step in range(self.grad_accum):
                x, y = self.batches()
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                # DDP and FSDP2 sync gradients in every backward: only the last micro-step's is needed
                last_micro = micro_step == self.grad_accum - 1
                with nullcontext() if last_micro or self.no_sync is None else self.no_sync():
                    with self.autocast:
                        _, loss = self.model(x, y)
                    loss_sum += loss.detach()
                    self.scaler.scale(loss / self.grad_accum).backward()  # / grad_accum: the whole batch's mean
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the loss-scaled ones
        total_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        grad_norm = local(total_norm)  # FSDP2: a replicated DTensor
        not_finite = torch.zeros((), device=self.device)
        if self.check_finite:
            finite = torch.isfinite(loss_sum)
            if not self.scaler.is_enabled():
                finite &= torch.isfinite(grad_norm)
            not_finite = (~finite).float()
        stop_flag = loss_sum.new_full((), float(stop_requested))  # a fill on the device, not a copy from the host
        # one all-reduce carries the loss to log, the stop requests and the non-finite flags: all ranks decide alike
        shared = sum_across_ranks(torch.stack([loss_sum / self.grad_accum, stop_flag, not_finite]))
        if self.scaler.is_enabled():
            # fp16: the scaler hands the fused update its own found_inf (non-finite gradients); a non-finite loss
            # whose gradients came out finite is caught here, on the host, before the update
            torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, total_norm)
            if shared[2].item() == 0:
                self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.found_inf = (shared[2] > 0).float()  # read by the fused update on the device
            if math.isfinite(self.grad_clip):
                # the clip rides on the fused update: it divides each gradient by grad_scale as it reads it (the
                # slot a GradScaler's scale takes) and writes it back divided, in place of clip_grad_norm_'s own
                # pass over every gradient: one read of the gradients less
                self.optimizer.grad_scale = ((grad_norm + 1e-6) / self.grad_clip).clamp(min=1.0)
            self.optimizer.step()
            del self.optimizer.found_inf
            self.optimizer.__dict__.pop("grad_scale", None)
        return LaunchedStep(torch.cat([shared, grad_norm.float().reshape(1)]), self.world_size, started)
