"""DDP and FSDP2 plumbing. torchrun starts one process per GPU and tells each its place through the
environment (RANK, LOCAL_RANK, WORLD_SIZE); a plain `python train.py` is a world of one.

Checkpoints are one file in one format whatever the strategy: FSDP2's shards are gathered into the full state dicts
that DDP's rank 0 holds (optimizer state keyed by parameter index, as optimizer.state_dict() keys it), so a run resumes
on any number of processes under either strategy."""
import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

# rank 0 alone receives the gathered tensors, on the CPU: a GPU need not hold the whole model at once
FULL_ON_MAIN = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass(frozen=True)
class World:
    rank: int = 0
    local_rank: int = 0  # index of this process's GPU on its machine
    size: int = 1

    @property
    def is_main(self) -> bool:  # the one process that logs, samples and writes files
        return self.rank == 0


def world_from_env() -> World:
    if "RANK" not in os.environ:
        return World()
    return World(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))


def init_process_group(world: World, device: torch.device, timeout_s: int) -> None:
    if "RANK" not in os.environ:
        return
    # nccl talks GPU to GPU; gloo lets the same code run (and be tested) on CPUs. A collective still waiting after
    # timeout_s fails (gloo raises; NCCL's watchdog aborts the process), so a hung rank cannot stall the job for ever
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None,
                            timeout=timedelta(seconds=timeout_s))


def shard(model: torch.nn.Module) -> None:
    """FSDP2 in place: each transformer block is its own unit (its weights are gathered just before it runs and
    freed after), the root holds the rest (embeddings, final norm, the tied head). The model must already hold the
    same weights on every rank (broadcast_from_main): each rank keeps its shard of its own copy."""
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)


def data_parallel(model: torch.nn.Module, device: torch.device, bucket_mb: int, reduce_dtype: str) -> DDP:
    """model under DDP: each bucket of bucket_mb of gradients is all-reduced as soon as the backward has filled it,
    the gradients held in the buckets themselves (gradient_as_bucket_view: no copy in and out). reduce_dtype
    "bfloat16": the all-reduce moves bf16, half the bytes of float32 (bf16_mean)."""
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_mb,
              gradient_as_bucket_view=True)
    if reduce_dtype == "bfloat16":
        ddp.register_comm_hook(None, bf16_mean)
    return ddp


def bf16_mean(_state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook for reduce_dtype bfloat16: the bucket's float32 gradients, divided by the number of
    ranks first (the sum then stays in range) and cast to bf16, are summed across the ranks, and the mean comes back
    into the float32 bucket."""
    grads = bucket.buffer()
    reduced = (grads / dist.get_world_size()).to(torch.bfloat16)

    def back_into_bucket(future: torch.futures.Future) -> torch.Tensor:
        return grads.copy_(future.value()[0])

    return dist.all_reduce(reduced, async_op=True).get_future().then(back_into_bucket)


def broadcast_from_main(model: torch.nn.Module) -> None:
    """Rank 0's weights and buffers on every rank, as DDP's constructor does."""
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)


@contextmanager
def fsdp_no_sync(model):
    """FSDP2's gradients reduce-scattered only on the last micro-step, as DDP's no_sync() does."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of an FSDP2 DTensor; any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_state(model: torch.nn.Module, optimizer, sharded: bool) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts as one process holds them. sharded: gathered from every rank (a
    collective), whole on rank 0 only, empty elsewhere."""
    if not sharded:
        return model.state_dict(), optimizer.state_dict()
    weights = get_model_state_dict(model, options=FULL_ON_MAIN)
    by_name = get_optimizer_state_dict(model, optimizer, options=FULL_ON_MAIN)
    if not by_name:
        return weights, by_name
    index = {name: i for i, name in enumerate(name for group in by_name["param_groups"] for name in group["params"])}
    return weights, {"state": {index[name]: state for name, state in by_name["state"].items()},
                     "param_groups": [{**group, "params": [index[n] for n in group["params"]]}
                                      for group in by_name["param_groups"]]}


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict, sharded: bool) -> None:
    """full_state's optimizer dict (every rank holds it) into the optimizer; sharded: each rank keeps its shard."""
    if not sharded:
        optimizer.load_state_dict(state)
        return
    names = {p: name for name, p in model.named_parameters()}
    name_of = [names[p] for group in optimizer.param_groups for p in group["params"]]
    by_name = {"state": {name_of[i]: s for i, s in state["state"].items()},
               "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]}
                                for group in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


class LostRankError(RuntimeError):
    """A collective failed: another rank died, hung past the timeout, or its machine went away."""


def lost_contact(err: BaseException) -> LostRankError | None:
    """err as a LostRankError when a collective raised it (NCCL's errors are DistErrors; gloo's plain RuntimeErrors
    that name it), else None: any other error keeps its traceback."""
    if not (isinstance(err, dist.DistError) or "gloo" in str(err)):
        return None
    reason = str(err).strip().splitlines()[0].split(". ")[0]  # gloo adds advice and an emoji after the cause
    return LostRankError(f"lost contact with the other processes ({reason}): a rank died, or hung past "
                         "--dist_timeout; see the first failure in the job's log, then continue with --resume")


def sum_across_ranks(tensor: torch.Tensor) -> torch.Tensor:
    # SUM rather than AVG: gloo has no AVG, and callers divide by the world size themselves
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_to_main(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] (every rank receives the list; only rank 0 needs it)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def wait_for_all_ranks() -> None:
    if dist.is_initialized():
        dist.barrier()


def close_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
