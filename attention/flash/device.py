"""What the Triton kernels run on: a CUDA GPU, or the CPU through Triton's interpreter; float16, bfloat16 and
float32; head dims 16..256. The Hopper kernels (§12, §13) need an sm_90 GPU on top of that.

Kernel modules are imported on first use (attention/registry.py), so a user can set TRITON_INTERPRET=1 first:
Triton decides when a kernel is defined whether it runs compiled on the GPU or in its CPU interpreter.
"""
import functools
import os

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Gluon, Triton's lower-level language the Hopper kernels are written in (hopper/), is experimental and its API moves
# between releases: they are written for, and compile with, Triton 3.6 and 3.9. Older Triton has no Gluon or another
# API; the `tl` kernels then run everywhere.
HAS_GLUON = tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 6)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # tl.dot needs >= 16; a 256-wide tile is the most that fits on chip


def check_triton_support(q: torch.Tensor) -> None:
    """What the Triton kernels add to inputs.check_qkv's checks: dtype, head dim, device."""
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the triton attention kernels support float16, bfloat16 and float32, got {q.dtype}; "
                        "cast q, k, v with .float() or use backend='naive' for float64")
    D = q.shape[-1]
    if not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(f"the triton attention kernels support head_dim {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {D}; "
                         "change n_embd / n_head, or use backend='sdpa' for this head size")
    check_triton_device(q.device)
    if INTERPRET and q.dtype == torch.bfloat16:
        raise TypeError("Triton's CPU interpreter (TRITON_INTERPRET=1) computes bfloat16 products wrong, so the triton "
                        "kernels refuse bfloat16 there; use float16 or float32 on the CPU, or bfloat16 on a GPU")


def check_triton_device(device: torch.device) -> None:
    """The Triton kernels run on a CUDA device, or on the CPU in Triton's interpreter (TRITON_INTERPRET=1)."""
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(f"the triton attention kernels run on a CUDA GPU, and this runs on {device}; use a dense "
                         "backend such as sdpa there, or set TRITON_INTERPRET=1 to run the kernels in Triton's "
                         "(slow) CPU interpreter")


@functools.cache
def is_hopper(device: torch.device) -> bool:
    """An sm_90 GPU (H100, H200): wgmma and setmaxnreg, which the Gluon kernels use, are Hopper's alone."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


@functools.cache
def softcap_tanh(device: torch.device) -> int:
    """§15 the `tl` kernels' SOFTCAP switch for a call with a softcap on this device, which tanh it takes: 2 (the
    special-function unit's tanh.approx.f32, one instruction: sm_75 and newer) or 1 (from the exp2 and a division:
    Triton's interpreter, older GPUs); tl_tiles.SOFTCAP_TANH_APPROX and SOFTCAP_EXP2."""
    if INTERPRET or device.type != "cuda" or torch.cuda.get_device_capability(device) < (7, 5):
        return 1
    return 2


@functools.cache
def has_tma(device: torch.device) -> bool:
    """Hopper or newer: the tensor memory accelerator (the copy engine) that descriptor loads use (§9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
