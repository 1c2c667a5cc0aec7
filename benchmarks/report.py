"""What the benchmarks' reports share: the environment record, number formatting, markdown tables,
CSV/JSON writing, and a headless matplotlib with small PNGs."""
import csv
import datetime
import functools
import io
import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path

import torch


def environment(device: torch.device) -> dict:
    """Software and hardware the numbers came from. No hostname: results get committed."""
    import triton  # here, not at the top: importing triton fixes its interpreter mode, callers choose that first

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device.type,
        "gpu": None,
        "driver": None,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["driver"] = _nvidia_driver_version()
    return env


def _nvidia_driver_version() -> str | None:
    # torch knows the CUDA driver API version only, not the driver release (e.g. 570.124.06)
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def slug(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200', for folder names."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def parse_bool(text: str) -> bool:
    """true/false/1/0 for command-line flags, as train.py takes them."""
    if text.lower() in ("true", "1"):
        return True
    if text.lower() in ("false", "0"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def fmt(x, digits: int = 3) -> str:
    """Three significant figures, no exponent for large numbers; '-' for a missing value.
    Tests compare table cells to the JSON through this same function."""
    if x is None:
        return "-"
    if abs(x) >= 10**digits:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def measured(x: float) -> float:
    """A measurement as results.json keeps it: six significant figures, far finer than a timing's noise (a float's
    seventeen would only make the raw files larger)."""
    return float(f"{x:.6g}")


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def json_text(obj) -> str:
    """obj as JSON, a line per top-level key and per row of a list of rows, each compact: as readable and diffable
    as one field per line, in a third less space (the repository keeps these files)."""
    if not isinstance(obj, dict):
        return json.dumps(obj, separators=(",", ":"))
    lines = []
    for key, value in obj.items():
        if isinstance(value, list) and value and all(isinstance(row, dict) for row in value):
            value_text = "[\n" + ",\n".join("  " + json.dumps(row, separators=(",", ":")) for row in value) + "\n ]"
        else:
            value_text = json.dumps(value, separators=(",", ":"))
        lines.append(f" {json.dumps(key)}: {value_text}")
    return "{\n" + ",\n".join(lines) + "\n}"


def write_json(path: Path, obj) -> None:
    # write-then-rename: a run killed mid-write (e.g. by a time limit) leaves the last good file
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json_text(obj) + "\n")
    os.replace(tmp, path)


def write_results(out_dir: str | Path, rows: list[dict], text: str) -> None:
    """A benchmark's raw rows (results.json, with the machine it ran on) and its printed table (results.md)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "results.json", {"env": environment(torch.device("cuda")), "rows": rows})
    (out_dir / "results.md").write_text(text + "\n")


def write_csv(path: Path, rows: list[dict]) -> None:
    """rows as CSV; a column for every key any row has (a triton row carries its tuner's choices, others do not)."""
    fieldnames = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(rows)


@functools.cache  # import and say so once
def pyplot():
    """matplotlib.pyplot drawing to files only (the GPU box and CI have no display), or None without
    matplotlib: the measurements and tables must not be lost to a missing plotting library."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib, then re-run the report)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PNG_DPI = 90  # the figures' resolution: legible in a README, and small in the repository that ships them
MOST_POINTS = 500  # about one point per pixel of a panel's width: more only thicken a long curve's PNG


def save_png(fig, path: Path) -> None:
    """fig as a PNG of at most 256 colours, then closed. Plots have a few line colours and their antialiasing,
    which a palette holds; full RGBA takes several times the bytes the repository ships per figure."""
    from PIL import Image  # matplotlib's own dependency

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=PNG_DPI, bbox_inches="tight")  # a title wider than one panel stays whole
    pyplot().close(fig)
    Image.open(buffer).convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def thin(xs: list, ys: list, most: int = MOST_POINTS) -> tuple[list, list]:
    """A curve of more than `most` points as every k-th of them, its last kept: what a plot can show of a long
    run (the tables hold every value)."""
    k = -(-len(xs) // most)  # ceil
    if k <= 1:
        return list(xs), list(ys)
    keep = list(range(0, len(xs), k)) + ([len(xs) - 1] if (len(xs) - 1) % k else [])
    return [xs[i] for i in keep], [ys[i] for i in keep]


def rotations(items: list, rounds: int) -> list[list]:
    """The order of each of `rounds` rounds: round r starts r items further along and steps through them by its own
    stride (1, n - 1, 2, n - 2, ..., those coprime with n, so each order holds every item once). Why: a cell runs at
    the clock the cell before it left (docs/perf_notes.md §1), and rotating one order keeps each item's predecessor
    round after round; with the strides it changes every round."""
    n = len(items)
    strides = [s for k in range(1, n) for s in (k, n - k) if math.gcd(s, n) == 1]
    strides = list(dict.fromkeys(strides)) or [1]
    return [[items[(r + k * strides[r % len(strides)]) % n] for k in range(n)] for r in range(rounds)]


def default_out_dir(name: str) -> Path:
    """out/<name>/: where a tool writes unless told otherwise (out/ is git-ignored; the raw files behind the README's
    tables are copied into benchmarks/results/<table>/ by benchmarks/gpu_session.sh)."""
    return Path("out") / name
