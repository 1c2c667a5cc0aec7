"""Start-up: the Triton kernels a run's attention will call, compiled by a helper process into Triton's on-disk cache
while the run itself imports, builds and traces its model (docs/training.md, "Start-up").

    helper = warm_kernels.start(model_config, batch_size, dtype, device, local_rank)   # None: nothing to warm

Triton compiles a kernel when it is first launched, so a fresh run would compile ours one after another in its own
process, each when the compiled model first reaches it (the forward at the first evaluation, the backward at the first
step), seconds that torch.compile's own kernels spend in parallel worker processes. The helper runs one attention
layer of the model, in the run's dtype and batch shape, forward under no_grad (evaluation), then forward and backward
(training): the same calls with the same layouts, so each kernel's cache entry is the one the run then looks up and
loads instead of compiling. It exits when done; a run that ends first stops it. With a warm cache it only loads.
"""
import atexit
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from model import CausalSelfAttention, GPTConfig

ROOT = Path(__file__).resolve().parents[1]


def start(model_config, batch_size: int, dtype: torch.dtype, device: torch.device,
          local_rank: int) -> subprocess.Popen | None:
    """Start the helper for a model (GPTConfig) whose attention runs our Triton kernels on a GPU, one per machine
    (local rank 0: the ranks share the cache). Not with documents (their masks come with each batch) or with
    NANOFLASH_WARM=0. -> the helper, or None."""
    if (model_config.attn != "triton" or model_config.doc_mask or device.type != "cuda" or local_rank != 0
            or os.environ.get("NANOFLASH_WARM", "1") == "0"):
        return None
    spec = dict(config=asdict(model_config), batch_size=batch_size, dtype=str(dtype).removeprefix("torch."),
                device=str(device))
    # NANOFLASH_NATIVE=0: the helper's calls need no C++ launcher (flash/native.py), whose build it would start
    helper = subprocess.Popen([sys.executable, "-m", "training.warm_kernels", json.dumps(spec)], cwd=ROOT,
                              env={**os.environ, "NANOFLASH_NATIVE": "0"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    atexit.register(stop, helper)
    return helper


def stop(helper: subprocess.Popen) -> None:
    if helper.poll() is None:
        os.killpg(helper.pid, signal.SIGTERM)


def run(spec: dict) -> None:
    """One attention layer of spec's model: its evaluation forward, then a training forward and backward."""
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = GPTConfig(**spec["config"])
    layer = CausalSelfAttention(config).to(device)
    B, T, C = spec["batch_size"], config.block_size, config.n_embd
    x = torch.randn(B, T, C, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=getattr(torch, spec["dtype"]), enabled=spec["dtype"] != "float32"):
        layer.eval()
        with torch.no_grad():
            layer(x)
        layer.train()
        y = layer(x)
    # a dense gradient, as the model's next layer gives it (a sum's would be a stride-0 view: another layout)
    y.backward(torch.randn_like(y))
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    os.nice(5)  # behind the run's own work
    run(json.loads(sys.argv[1]))
