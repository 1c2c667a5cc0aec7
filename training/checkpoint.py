"""Checkpoints that are verified before they are trusted, and the RNG states that make a resume exact.

A run keeps two: {out_dir}/ckpt.pt, the newest, and ckpt.prev.pt, the one before. Each is torch.save's zip archive
with one more record, a SHA-256 digest of every other record, written when it is saved and checked when it is loaded:
a flipped byte, a truncated copy or a file that is not a checkpoint fails the check instead of training on. A resume
takes the newest that passes, saying so when that is the previous one. Saving writes a temporary file (the digest read back
from it as written), then rotates: the newest becomes the previous (if it is good) and the new file the newest, each step a rename.
"""
import glob
import hashlib
import os
import random
import zipfile

import numpy as np
import torch


NAME, PREVIOUS = "ckpt.pt", "ckpt.prev.pt"
DIGEST_RECORD = "nanoflash_sha256"  # the archive's extra record: the hex digest of all the others
# what every checkpoint of train.py holds
KEYS = ("model", "optimizer", "scaler", "model_config", "train_config", "step", "best_val_loss", "train_loader", "rng")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the way out."""


class Checkpoints:
    """The newest and the previous checkpoint of the run in out_dir."""

    def __init__(self, out_dir: str):
        self.newest, self.previous = os.path.join(out_dir, NAME), os.path.join(out_dir, PREVIOUS)
        self.newest_verified = False  # written or loaded by this process: it may become the previous as it is
        self.last_good: str | None = None  # the checkpoint this process loaded or wrote last, known to be good

    def where_to_resume(self) -> str:
        """For error messages: where the run can go on from."""
        if self.last_good is None:
            return "no checkpoint of this run was saved yet: start it again"
        return f"{self.last_good} is the last good checkpoint: continue with --resume"

    def load(self, log=print) -> dict:
        """The newest checkpoint that passes its check; the previous one, with a message, when the newest fails.
        -> the state; CheckpointError when neither exists or both fail."""
        if not os.path.exists(self.newest) and not os.path.exists(self.previous):
            raise CheckpointError(f"no checkpoint at {self.newest}; drop --resume to start a new run, or point "
                                  "--out_dir at the folder of the run to continue")
        failures = []
        for path in (self.newest, self.previous):
            if not os.path.exists(path):
                failures.append(f"{path} is missing")
                continue
            try:
                state = read_checkpoint(path)
            except CheckpointError as err:
                failures.append(str(err))
                continue
            if path == self.previous:
                log(f"{failures[0]}; resuming from the previous checkpoint {path} (step {state['step']})")
            self.newest_verified, self.last_good = path == self.newest, path
            return state
        raise CheckpointError("; ".join(failures) + "; no good checkpoint to resume from: restore one from a backup, "
                              "or drop --resume to start a new run")

    def save(self, state: dict) -> None:
        """Write state as the newest checkpoint, the current newest becoming the previous one if it is good."""
        folder = os.path.dirname(self.newest) or "."
        os.makedirs(folder, exist_ok=True)
        for stale in glob.glob(os.path.join(glob.escape(folder), f"{NAME}.*.tmp")):
            os.unlink(stale)  # a write that a kill cut short
        tmp = f"{self.newest}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w+b") as f:
                write_checkpoint(state, f)
                f.flush()
                os.fsync(f.fileno())
            if os.path.exists(self.newest) and (self.newest_verified or _passes(self.newest)):
                os.replace(self.newest, self.previous)
            os.replace(tmp, self.newest)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        _sync_folder(folder)
        self.newest_verified, self.last_good = True, self.newest


def write_checkpoint(state: dict, f) -> None:
    """torch.save(state) into f (a file open for reading and writing), then the digest record of all torch wrote."""
    torch.save(state, f)
    f.flush()
    with zipfile.ZipFile(f, "a") as archive:
        prefix = archive.namelist()[0].split("/")[0]
        archive.writestr(f"{prefix}/{DIGEST_RECORD}", _digest(archive))


def read_checkpoint(path: str, digest_only: bool = False) -> dict | None:
    """The state in path once its digest checks out; CheckpointError (naming the file) otherwise."""
    try:
        with zipfile.ZipFile(path) as archive:
            record = next((n for n in archive.namelist() if n.endswith("/" + DIGEST_RECORD)), None)
            if record is None:
                raise CheckpointError(f"{path} has no digest record: not a checkpoint of this trainer, or one cut "
                                      "short")
            if archive.read(record).decode(errors="replace") != _digest(archive, skip=record):
                raise CheckpointError(f"{path} failed its digest check: its bytes changed after it was written")
    except CheckpointError:
        raise
    except Exception as err:  # not a zip archive, a truncated one, a record whose CRC fails, a short read
        raise CheckpointError(f"{path} is damaged or not a checkpoint ({type(err).__name__}: {err})") from None
    if digest_only:
        return None
    try:
        # weights_only: a checkpoint is data, so loading one must not run pickled code
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # the digest held, so the writer itself wrote something torch cannot read
        raise CheckpointError(f"{path} passed its digest check but does not load ({type(err).__name__}: {err})") \
            from None
    if not isinstance(state, dict) or any(key not in state for key in KEYS):
        raise CheckpointError(f"{path} is not a checkpoint of train.py (it lacks {', '.join(KEYS)})")
    return state


def _digest(archive: zipfile.ZipFile, skip: str | None = None) -> str:
    """SHA-256 over every record's name and bytes, in archive order; zipfile checks each record's CRC as it reads."""
    h = hashlib.sha256()
    for info in archive.infolist():
        if info.filename == skip:
            continue
        h.update(info.filename.encode())
        with archive.open(info) as record:
            for chunk in iter(lambda: record.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _passes(path: str) -> bool:
    try:
        read_checkpoint(path, digest_only=True)
        return True
    except CheckpointError:
        return False


def _sync_folder(folder: str) -> None:
    """The renames live in the folder's metadata: sync it, or a power loss can undo them."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
