"""What a run checks and picks before it builds anything (train.py, the benchmarks, examples/train_llama.py): the
device, the dtype and TF32, whether the attention backend runs there, whether out_dir can be written and the Hub
reached. Each problem is a ConfigError whose one line names the way out.
"""
import os
import socket
from urllib.parse import urlparse

import torch

from attention import get_backend
from training.config import ConfigError, TrainConfig
from training.distributed import World


def pick_device(cfg: TrainConfig, world: World) -> torch.device:
    name = cfg.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={cfg.device!r} but torch sees no CUDA GPU; pass --device=cpu")
    if name == "cuda" or (name.startswith("cuda") and "RANK" in os.environ):
        name = f"cuda:{world.local_rank}"  # under torchrun each process drives the GPU of its local rank
    return torch.device(name)


def check_attention_device(cfg: TrainConfig, device: torch.device) -> None:
    """The attention backend runs on this device, or a ConfigError naming the choices (before anything is built)."""
    check = get_backend(cfg.attn).check_device
    try:
        if check is not None:
            check(device)
    except ValueError as err:
        raise ConfigError(f"--attn={cfg.attn}: {err}") from None


def check_out_dir(path: str) -> None:
    """out_dir can take the run's files, or a ConfigError naming the way out: checked before anything is built or
    downloaded. The folder itself may not exist yet; its nearest existing parent must be a folder we may write."""
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing) or "."
    if not os.path.isdir(existing):
        raise ConfigError(f"out_dir {path!r} cannot be made: {existing!r} is a file; pass --out_dir=a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"out_dir {path!r} cannot be written: {existing!r} is read-only; pass --out_dir=a folder "
                          "you can write to")


def check_hub_reachable(name: str) -> None:
    """GPT-2 weights by name come from the Hugging Face cache or its Hub; offline and not cached, say so in a line
    now rather than after transformers' retries."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:
        return  # GPT.from_pretrained names what to install
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    way_out = "run once online, or pass the path of a downloaded model.safetensors"
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"init_from={name}: the weights are not in the Hugging Face cache, and HF_HUB_OFFLINE is "
                          f"set; {way_out}")
    host = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((host.hostname, host.port or 443), timeout=5).close()
    except OSError as err:
        raise ConfigError(f"init_from={name}: the weights are not in the Hugging Face cache and {host.hostname} cannot "
                          f"be reached ({err}); {way_out}")


def pick_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    name = cfg.dtype
    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported()
    if name == "auto":
        # fp32 on CPU: autocast there is slow and lossy, and the CPU runs are tests and smoke runs
        name = "float32" if device.type == "cpu" else "bfloat16" if bf16_ok else "float16"
    if name == "bfloat16" and not bf16_ok:
        raise ConfigError(f"{torch.cuda.get_device_name(device)} has no bfloat16; pass --dtype=float16")
    if name == "float16" and cfg.parallel == "fsdp":
        # the loss scaler would judge each rank's gradient shard alone, and the ranks would skip steps apart
        raise ConfigError("parallel=fsdp does not train in float16 (its loss scaler sees one shard); pass "
                          "--dtype=bfloat16 or --dtype=float32, or --parallel=ddp")
    return getattr(torch, name)


def set_tf32(cfg: TrainConfig, device: torch.device) -> None:
    """TF32 for the float32 matmuls and convolutions that remain (tf32=true), or exact float32 (tf32=false)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = cfg.tf32
