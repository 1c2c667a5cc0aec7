"""The on-disk token format that the preparation scripts write and the loader reads: a shard is a
1-D uint16 array saved with np.save as {data_dir}/{split}_{index:06d}.npy, and {data_dir}/index.json records,
once the preparation has finished, every shard's length, size and largest token id and the command that wrote them.
The loader checks each shard against it when it opens the data (check_shard), so a truncated, damaged or foreign
shard is refused with its name and that command instead of failing mid-training."""
import glob
import json
import os

import numpy as np

INDEX = "index.json"


class ShardError(ValueError):
    """A shard or index that cannot be used; the message names the file and how to re-create it."""


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


def load_shard(path: str, fix: str = "write shards with data.shards.write_shard") -> np.ndarray:
    """Memory-map a shard: only the pages a batch touches are read from disk. fix: how to re-create it, for errors."""
    try:
        with open(path, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise ValueError("no .npy header")
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as err:  # a missing or short file, a garbled header (numpy parses it as Python: any error)
        raise ShardError(f"{path} is not a readable token shard ({type(err).__name__}: {err}); {fix}") from None
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
        raise ShardError(f"{path} holds a {tokens.dtype} array of shape {tokens.shape}, not 1-D uint16 tokens; {fix}")
    return tokens


def write_index(data_dir: str, made_by: str) -> dict:
    """Read every shard in data_dir once and record, by file name, its token count, byte size and largest token id,
    with made_by, the command that re-creates them. The preparation scripts call it last: a data_dir without an
    index was not finished."""
    shards = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(data_dir), "*_" + "[0-9]" * 6 + ".npy"))):
        tokens = load_shard(path)
        shards[os.path.basename(path)] = {"tokens": len(tokens), "bytes": os.path.getsize(path),
                                          "max_token": int(tokens.max()) if len(tokens) else -1}
    index = {"made_by": made_by, "shards": shards}
    atomic_write(os.path.join(data_dir, INDEX), lambda f: f.write(json.dumps(index, indent=1).encode()))
    return index


def read_index(data_dir: str) -> dict:
    path = os.path.join(data_dir, INDEX)
    if not os.path.isfile(path):
        raise ShardError(f"{data_dir} has no {INDEX}, which the preparation script writes when it finishes; "
                         "prepare the data (again): python -m data.shakespeare, or python -m data.fineweb")
    try:
        index = json.loads(open(path, "rb").read())
        _, shards = index["made_by"], index["shards"]  # both keys, or the index is damaged
        if not isinstance(shards, dict):
            raise TypeError("shards is not a table")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise ShardError(f"{path} is damaged ({type(err).__name__}: {err}); prepare the data again: "
                         "python -m data.shakespeare, or python -m data.fineweb") from None
    return index


def check_shard(path: str, index: dict, vocab_size: int | None = None) -> int:
    """Check a shard against its index entry without reading its tokens: the file's size, its .npy header (a 1-D
    uint16 array of the indexed length) and the indexed largest token id against the model's vocab_size.
    -> its token count; ShardError otherwise."""
    entry = index["shards"].get(os.path.basename(path))
    fix = f"re-create it with `{index['made_by']}`"
    if entry is None:
        raise ShardError(f"{path} is not in {INDEX} (left from another preparation?); delete it, or {fix}")
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        raise ShardError(f"{path} holds {size} bytes, its index says {entry['bytes']}: truncated or damaged; {fix}")
    tokens = load_shard(path, fix)
    if len(tokens) != entry["tokens"]:
        raise ShardError(f"{path} holds {len(tokens)} tokens, its index says {entry['tokens']}: damaged; {fix}")
    if vocab_size is not None and entry["max_token"] >= vocab_size:
        raise ShardError(f"{path} holds token id {entry['max_token']}, and the model's vocabulary has {vocab_size}: "
                         f"shards of another tokenizer? {fix.capitalize()} for this model, or set vocab_size")
    return len(tokens)


def check_tokens(path: str, tokens: np.ndarray, index: dict, vocab_size: int | None) -> None:
    """What check_shard cannot see without reading the tokens: the largest id actually there, against the index
    and the vocabulary (a shard overwritten after its preparation). One pass over the shard."""
    largest = int(tokens.max()) if len(tokens) else -1
    indexed = index["shards"][os.path.basename(path)]["max_token"]
    if largest > indexed or (vocab_size is not None and largest >= vocab_size):
        raise ShardError(f"{path} holds token id {largest} (its index says at most {indexed}, the model's vocabulary "
                         f"has {vocab_size}): damaged after its preparation; re-create it with "
                         f"`{index['made_by']}`")
