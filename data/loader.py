"""Batches of token sequences from memory-mapped shards, each DDP rank reading its own slice.

All ranks walk the shards in lockstep. A shared base position advances by world_size*B*T tokens per
batch and rank r reads the B*T+1 tokens from base + r*B*T, so the ranks see disjoint data and together
read exactly what one process with a world_size-times-larger batch would. An optimizer step of `accumulation`
micro-batches per rank reads one contiguous world_size*accumulation*B*T chunk, and a shard with fewer tokens than
that (+1) left when a step ends is done; after the last shard the loader starts over from the first. So the same
global batch split as 1 GPU x 4 micro-batches or 4 GPUs x 1 reads the same tokens in every step, epochs included.
A step larger than a whole shard cannot stay inside one: there the shard is done when a batch no longer fits.

Every shard is checked against the data's index when the loader starts (its size, header and length, and with
vocab_size its largest token id; data/shards.py), and its tokens are read through once when it is first opened, so a
damaged shard is refused with its name and the command that re-creates it, never fed to the model.
"""
import os

import numpy as np
import torch

from .shards import INDEX, ShardError, check_shard, check_tokens, find_shards, load_shard, read_index


class TokenLoader:
    def __init__(self, data_dir: str, split: str, batch_size: int, block_size: int,
                 rank: int = 0, world_size: int = 1, vocab_size: int | None = None, accumulation: int = 1):
        for name, value in (("batch_size", batch_size), ("block_size", block_size), ("world_size", world_size),
                            ("accumulation", accumulation)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in [0, world_size={world_size}), got {rank!r}; "
                             "under torchrun pass int(os.environ['RANK']) and int(os.environ['WORLD_SIZE'])")
        prepare_hint = "prepare the data first, e.g. `python -m data.shakespeare` (or `python -m data.fineweb`)"
        if not os.path.isdir(data_dir):
            raise FileNotFoundError(f"data_dir {data_dir!r} does not exist; {prepare_hint}")
        self.shards = find_shards(data_dir, split)
        if not self.shards:
            raise FileNotFoundError(f"no {split}_*.npy shards in {data_dir!r}; {prepare_hint}")

        self.data_dir, self.split = data_dir, split
        self.batch_size, self.block_size, self.rank, self.world_size = batch_size, block_size, rank, world_size
        self.tokens_per_batch = world_size * batch_size * block_size  # how far the shared base moves per batch
        self.accumulation, self.batches_into_step = accumulation, 0
        # +1: the target of a batch's last position is the token just after it
        need = self.tokens_per_batch + 1
        self.index, self.vocab_size = read_index(data_dir), vocab_size
        found = {os.path.basename(path) for path in self.shards}
        missing = sorted(os.path.join(data_dir, name) for name in self.index["shards"]
                         if name.startswith(f"{split}_") and name not in found)
        if missing:
            raise ShardError(f"{data_dir} lacks {', '.join(missing)}, which its {INDEX} lists; restore them or "
                             f"re-create the data with `{self.index['made_by']}`")
        self.shard_sizes = [check_shard(path, self.index, vocab_size) for path in self.shards]
        self.read_through: set[int] = set()  # shards whose tokens check_tokens has read
        for path, size in zip(self.shards, self.shard_sizes):
            if size < need:
                raise ValueError(
                    f"shard {path} holds {size} tokens, fewer than one batch needs: world_size * batch_size * "
                    f"block_size + 1 = {world_size} * {batch_size} * {block_size} + 1 = {need}; "
                    "lower batch_size or block_size, or prepare more data"
                )
        self._open(0, 0)

    def _open(self, shard: int, position: int) -> None:
        self.shard, self.position = shard, position
        self.tokens = load_shard(self.shards[shard])
        if shard not in self.read_through:
            check_tokens(self.shards[shard], self.tokens, self.index, self.vocab_size)
            self.read_through.add(shard)

    def _next_shard_if_exhausted(self, step_boundary: bool = True) -> None:
        whole_step = self.tokens_per_batch * self.accumulation + 1
        if len(self.tokens) < whole_step:  # no step fits in this shard: it is done when a batch does not
            need = self.tokens_per_batch + 1
        elif step_boundary:
            need = whole_step
        else:  # inside a step that was checked to fit when it began
            return
        if len(self.tokens) - self.position < need:
            self._open((self.shard + 1) % len(self.shards), 0)  # after the last shard: a new epoch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: (B, T) int64 on the CPU; y[b, t] is the token that follows x[b, t]."""
        B, T = self.batch_size, self.block_size
        start = self.position + self.rank * B * T
        buf = torch.from_numpy(self.tokens[start : start + B * T + 1].astype(np.int64))
        x = buf[:-1].view(B, T)
        y = buf[1:].view(B, T)
        self.position += self.tokens_per_batch
        self.batches_into_step = (self.batches_into_step + 1) % self.accumulation
        self._next_shard_if_exhausted(step_boundary=self.batches_into_step == 0)
        return x, y

    def state_dict(self) -> dict:
        """Where the next batch starts. It names the shared base position, not this rank's slice, so
        rank 0's state restores every rank. Taken between optimizer steps (train.py does), it restores on any split
        of the same global batch into ranks and micro-batches."""
        return {"split": self.split, "shard": self.shard, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or not {"split", "shard", "position"} <= state.keys():
            raise ValueError(f"expected a dict from TokenLoader.state_dict() with keys 'split', 'shard' and "
                             f"'position', got {state!r}")
        if state["split"] != self.split:
            raise ValueError(f"the state is for split {state['split']!r} but this loader reads {self.split!r}")
        shard, position = state["shard"], state["position"]
        if not 0 <= shard < len(self.shards):
            raise ValueError(f"the state points at shard {shard} but {self.data_dir!r} holds {len(self.shards)} "
                             f"{self.split} shards; resume with the data_dir the run started with")
        if not 0 <= position <= self.shard_sizes[shard]:
            raise ValueError(f"the state's position {position} lies outside shard {self.shards[shard]} "
                             f"({self.shard_sizes[shard]} tokens); resume with the data_dir the run started with")
        self._open(shard, position)
        self.batches_into_step = 0
        # a resume with a larger batch may find less than a batch left here
        self._next_shard_if_exhausted()
