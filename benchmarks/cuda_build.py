"""How long backend="cuda" takes to become ready: its first call in a process that finds no build in torch's
extension cache (nvcc and ninja compile attention/cuda/), then a second process that loads that build.

    python -m benchmarks.cuda_build --out_dir out/cuda   # -> build.json

Each process runs in a fresh interpreter with TORCH_EXTENSIONS_DIR pointing at a new empty folder (then at the same
folder again), so nothing this machine built before is reused.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIRST_CALL = """
import time, torch
from attention import attention
from attention.cuda.build import build_seconds
q = torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.bfloat16)
start = time.perf_counter()
attention(q, q, q, causal=True, backend="cuda")
torch.cuda.synchronize()
print(time.perf_counter() - start, *build_seconds.values())
"""


def timed_process(cache_dir: str) -> dict:
    """One fresh interpreter's first call of backend='cuda' -> its seconds: the process, the call, and the build or
    cache load inside the call."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": cache_dir}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    process = time.perf_counter() - start
    if out.returncode != 0:
        sys.exit(f"error: the first call of backend='cuda' failed:\n{out.stderr.strip().splitlines()[-1]}")
    call, build = map(float, out.stdout.split())
    return {"process_s": round(process, 2), "first_call_s": round(call, 2), "build_or_load_s": round(build, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out_dir", default="out/cuda")
    out_dir = Path(p.parse_args().out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    with tempfile.TemporaryDirectory() as cache:
        result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "fresh": timed_process(cache), "cached": timed_process(cache)}
    (out_dir / "build.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
