"""The on-disk token format that the preparation scripts write and the loader reads: a shard is a
1-D uint16 array saved with np.save as {data_dir}/{split}_{index:06d}.npy."""
import glob
import os

import numpy as np


def shard_path(data_dir: str, split: str, index: int) -> str:
    return os.path.join(data_dir, f"{split}_{index:06d}.npy")


def find_shards(data_dir: str, split: str) -> list[str]:
    """The split's shards in index order (zero-padded indices sort as strings)."""
    pattern = os.path.join(glob.escape(data_dir), f"{split}_" + "[0-9]" * 6 + ".npy")
    return sorted(glob.glob(pattern))


def atomic_write(path: str, write) -> None:
    """write(file) into a temporary file beside path, fsync, then rename it over path. A rename within
    one folder is atomic, so a crash (or a full disk) at any moment leaves the old file or the new
    one, never a truncated one. Shards and the trainer's checkpoints both go through here."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp_path = f"{path}.{os.getpid()}.tmp"  # never matches a shard or checkpoint name
    try:
        with open(tmp_path, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise
    # the rename itself lives in the folder's metadata: sync it too, or a power loss can undo it
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_shard(path: str, tokens: np.ndarray) -> None:
    """Save tokens (1-D uint16) atomically: np.save into a temporary file in the same folder, then
    rename it into place, so an interrupted preparation never leaves a half-written shard behind."""
    if not (isinstance(tokens, np.ndarray) and tokens.dtype == np.uint16 and tokens.ndim == 1):
        raise TypeError(f"a shard must be a 1-D uint16 numpy array, got {type(tokens).__name__} "
                        f"{getattr(tokens, 'dtype', '')} {getattr(tokens, 'shape', '')}; convert with tokenizer.to_uint16")
    atomic_write(path, lambda f: np.save(f, tokens))


def load_shard(path: str) -> np.ndarray:
    """Memory-map a shard: only the pages a batch touches are read from disk."""
    tokens = np.load(path, mmap_mode="r")
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
        raise ValueError(f"shard {path} holds a {tokens.dtype} array of shape {tokens.shape}, not 1-D uint16 "
                         "tokens; write shards with data.shards.write_shard")
    return tokens
