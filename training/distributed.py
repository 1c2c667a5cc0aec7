"""DDP plumbing. torchrun starts one process per GPU and tells each its place through the
environment (RANK, LOCAL_RANK, WORLD_SIZE); a plain `python train.py` is a world of one."""
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def init_process_group(world: World, device: torch.device) -> None:
    if "RANK" not in os.environ:
        return
    # nccl talks GPU to GPU; gloo lets the same code run (and be tested) on CPUs
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)


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
