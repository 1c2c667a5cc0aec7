"""Checkpoints that survive a crash mid-write, and the RNG states that make a resume exact."""
import os
import random

import numpy as np
import torch

from data.shards import atomic_write


def save_checkpoint(state: dict, path: str) -> None:
    """torch.save, atomically: a crash mid-write leaves the previous checkpoint intact."""
    atomic_write(path, lambda f: torch.save(state, f))


def load_checkpoint(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; drop --resume to start a new run, "
                                "or point --out_dir at the folder of the run to continue")
    # weights_only: a checkpoint is data, so loading one must not run pickled code
    return torch.load(path, map_location="cpu", weights_only=True)


def rng_state() -> dict:
    """Every random stream training draws from (dropout, sampling, numpy), as plain containers and
    tensors so that torch.load(weights_only=True) accepts them."""
    np_state = np.random.get_state(legacy=False)
    np_state["state"]["key"] = np_state["state"]["key"].tolist()
    return {
        "python": random.getstate(),
        "numpy": np_state,
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    np_state["state"]["key"] = np.array(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
