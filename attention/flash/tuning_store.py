"""The tuner's choices kept on disk, so that no process times a key another process has already timed.

    store = TuningStore.open(gpu=torch.cuda.get_device_name(), triton=triton.__version__, package="0.1.0",
                             shipped_dir=Path(__file__).parent / "tuned")
    choice = store.get(key)          # a JSON value, or None: time the candidates, then
    store.put(key, choice)           # JSON keeps lists, not tuples: the tuner turns a tile back into a tuple

One JSON file per GPU model, <cache_dir>/tuning/<gpu slug>.json:
    {"format": 2, "gpu": ..., "triton": ..., "package": ..., "choices": {key: value}}   (keys: tuner.stored_key)
The cache dir is $NANOFLASH_CACHE_DIR, else $XDG_CACHE_HOME/nanoflash, else ~/.cache/nanoflash. A file written for
another GPU, Triton or package version is stale: a tile's speed changes with the compiler, so its choices are
ignored and the file is replaced on the next put. Files shipped in the repository (shipped_dir, <gpu slug>.json.gz:
the same JSON, gzipped, as its keys repeat) serve when all three match; the user's own choices win over them.
store.export(shipped_dir) writes one.
"""
import gzip
import json
import os
import re
import tempfile
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock, so processes putting at the same moment may drop each other's entries
    fcntl = None

FORMAT = 2  # 2: keys as tuner.stored_key writes them
CORRUPT = "is not a readable nanoflash tuning file"


def gpu_slug(gpu: str) -> str:
    """A file-name-safe form of a GPU name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "unknown-gpu"


def default_cache_dir() -> Path:
    if os.environ.get("NANOFLASH_CACHE_DIR"):
        return Path(os.environ["NANOFLASH_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanoflash"


def _read(path: Path, header: dict) -> tuple[dict, str | None]:
    """The choices in path if it was written for header's GPU and versions, else {} and why not (None: no file)."""
    try:
        raw = path.read_bytes()
        data = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    except (FileNotFoundError, NotADirectoryError):  # no file yet, or no cache dir can be made there (put warns)
        return {}, None
    except (OSError, EOFError, ValueError):  # unreadable, a broken gzip stream, not UTF-8 or not JSON
        return {}, CORRUPT
    if not (isinstance(data, dict) and type(data.get("format")) is int and isinstance(data.get("choices"), dict)
            and all(isinstance(data.get(field), str) for field in ("gpu", "triton", "package"))):
        return {}, CORRUPT
    if any(data[field] != value for field, value in header.items()):
        found = ", ".join(f"{field} {data[field]}" for field in header)
        return {}, f"holds choices for another setup ({found})"
    return data["choices"], None


def _write(path: Path, header: dict, choices: dict) -> None:
    """Write path whole or not at all: a temp file in its folder, renamed over it, so no reader sees it torn."""
    # the header on the first line, then one choice a line: compact (the repository ships these files) and diffable
    lines = [f"{json.dumps(key)}:{json.dumps(choice, separators=(',', ':'))}" for key, choice in sorted(choices.items())]
    text = json.dumps(header, sort_keys=True)[:-1] + ', "choices": {\n' + ",\n".join(lines) + "\n}}\n"
    data = text.encode("utf-8")
    if path.suffix == ".gz":  # mtime 0: the same choices give the same bytes
        data = gzip.compress(data, mtime=0)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class TuningStore:
    def __init__(self, path: Path, header: dict, choices: dict):
        self.path = path  # the user cache file
        self.header = header  # {"format", "gpu", "triton", "package"}: what a file must match to be used
        self._choices = choices  # loaded once: get() is on the tuner's path
        self._in_memory = False  # set when the cache dir turns out unwritable

    @classmethod
    def open(cls, *, gpu: str, triton: str, package: str, cache_dir: Path | str | None = None,
             shipped_dir: Path | str | None = None) -> "TuningStore":
        header = {"format": FORMAT, "gpu": gpu, "triton": triton, "package": package}
        name = gpu_slug(gpu) + ".json"
        path = Path(cache_dir or default_cache_dir()) / "tuning" / name
        shipped_path = Path(shipped_dir) / (name + ".gz") if shipped_dir else None
        shipped, why = _read(shipped_path, header) if shipped_path else ({}, None)
        if why == CORRUPT:  # a shipped file for other versions is expected and skipped quietly: those tune anew
            warnings.warn(f"nanoflash: {shipped_path} {CORRUPT}; ignored")
        mine, why = _read(path, header)
        if why:
            warnings.warn(f"nanoflash: {path} {why}; ignored, it will be rebuilt on the next tuning")
        return cls(path, header, {**shipped, **mine})

    def get(self, key: str):
        return self._choices.get(key)

    def put(self, key: str, value) -> None:
        """Keep value for key in this process and in the user file, merged with what other processes put there."""
        self._choices[key] = value
        if self._in_memory:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Read-modify-write under an exclusive lock (DDP ranks tune at the same moment); the lock lives in its
            # own file because os.replace swaps the JSON file's inode. Closing the lock file releases it.
            with open(self.path.with_suffix(".lock"), "w") as lock:
                if fcntl:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                on_disk, _ = _read(self.path, self.header)  # a stale or corrupt file was reported by open()
                _write(self.path, self.header, {**on_disk, key: value})
        except OSError as e:  # a read-only home, a CI sandbox
            self._in_memory = True
            warnings.warn(f"nanoflash: cannot write {self.path} ({e}); tuning choices are kept in memory only")

    def export(self, shipped_dir: Path | str) -> Path:
        """Write every choice this store holds (shipped, the user's, this process's) as shipped_dir's file for its GPU
        (a GPU session runs the benchmarks, then exports into the repository). Returns the file's path."""
        path = Path(shipped_dir) / (self.path.name + ".gz")
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, self.header, dict(self._choices))
        return path
