"""Builds the CUDA kernels of this folder on first use, or says in one line what the machine lacks for them.

torch.utils.cpp_extension.load compiles binding.cpp, flash_forward.cu and flash_backward.cu with nvcc and ninja into
torch's extension cache (TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions), one build per GPU architecture;
a later process loads the cached module in well under a second, and a changed source or flag rebuilds it. Nothing
here is imported by `import attention`: torch.utils.cpp_extension is imported by load_extension, on the first call.
"""
import functools
import os
import shutil
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SOURCES = ("binding.cpp", "flash_forward.cu", "flash_backward.cu")
MIN_CAPABILITY = (8, 0)  # mma.sync with bf16, ldmatrix and cp.async: Ampere (sm_80) and newer
build_seconds: dict[tuple[int, int], float] = {}  # capability -> how long this process's build (or cache load) took


class CudaBackendUnavailable(ValueError):
    """What this machine lacks for backend='cuda', in one line. A ValueError, like every backend's check_device
    error, so that train.py reports it as one line (train.py: error: --attn=cuda: ...) before building anything."""


def _which(tool: str) -> str | None:
    """tool on PATH, or beside this Python (a virtual environment's bin/, where `pip install ninja` puts ninja even
    when the environment is not activated)."""
    found = shutil.which(tool)
    if found is None:
        beside = Path(sys.executable).parent / tool
        found = str(beside) if beside.exists() else None
    return found


def find_nvcc() -> str | None:
    """nvcc where torch.utils.cpp_extension looks for it: $CUDA_HOME (or $CUDA_PATH)/bin, PATH, /usr/local/cuda/bin."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    found = _which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").exists():
        found = "/usr/local/cuda/bin/nvcc"
    return found


def check_toolchain() -> None:
    """A CUDA build of torch, nvcc and ninja are here, or a CudaBackendUnavailable naming the first one missing."""
    if torch.version.cuda is None:
        raise CudaBackendUnavailable(
            f"the cuda attention backend needs a CUDA build of PyTorch, and this torch {torch.__version__} is "
            "CPU-only; install one from https://pytorch.org/get-started/locally/, or use backend='sdpa'")
    if find_nvcc() is None:
        raise CudaBackendUnavailable(
            "the cuda attention backend compiles its kernels on first use and needs nvcc, found neither in "
            f"$CUDA_HOME/bin nor on PATH; install the CUDA toolkit {torch.version.cuda} (the version torch was built "
            "with) and set CUDA_HOME, or use backend='triton'")
    if _which("ninja") is None:
        raise CudaBackendUnavailable(
            "the cuda attention backend builds its kernels with ninja, which is not on PATH; pip install ninja, or "
            "use backend='triton'")


def check_cuda_device(device: torch.device) -> None:
    """The kernels run on device and can be built here, or a one-line CudaBackendUnavailable saying what is missing
    (the registry's check_device for backend='cuda'; train.py calls it before building the model)."""
    if device.type != "cuda":
        raise CudaBackendUnavailable(
            f"the cuda attention kernels run on a CUDA GPU, and this runs on {device}; use a dense backend such as "
            "sdpa there")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise CudaBackendUnavailable(
            f"the cuda attention kernels need an sm_80 or newer GPU (bf16 mma.sync, cp.async), and this one is "
            f"sm_{capability[0]}{capability[1]}; use backend='sdpa' or 'triton'")
    if capability not in build_seconds:  # once built, the tools are not needed (nor PATH searched per call) again
        check_toolchain()


def load_extension(device: torch.device):
    """The compiled module (forward, backward) for device's architecture: built on the first call of the process,
    from torch's extension cache after that."""
    capability = torch.cuda.get_device_capability(device)
    if capability not in build_seconds:
        check_cuda_device(device)
    return _load(capability)


@functools.cache
def _load(capability: tuple[int, int]):
    from torch.utils.cpp_extension import load  # here, not at import: only a call of backend='cuda' needs it

    ninja = _which("ninja")
    if shutil.which("ninja") is None and ninja is not None:  # torch runs `ninja` from PATH
        os.environ["PATH"] = f"{Path(ninja).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    major, minor = capability
    start = time.perf_counter()
    module = load(
        name=f"nanoflash_cuda_attention_sm{major}{minor}",  # one cache entry per architecture
        sources=[str(HERE / source) for source in SOURCES],
        extra_cflags=["-O3"],
        extra_cuda_cflags=[
            "-O3",
            # no --use_fast_math: the one transcendental of the inner loops, 2^x, is already the hardware's
            # ex2.approx (fast_exp2 in flash_common.cuh); the flag would also make every division and square root
            # approximate and flush denormals, for nothing measurable here
            "-std=c++17",
            # only the GPU in use (torch would otherwise compile for every architecture it lists), and an arch flag
            # in extra_cuda_cflags keeps torch from adding its own
            f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}",
            "-lineinfo",  # source lines in profiles (Nsight Compute), no effect on the code
        ],
        verbose=os.environ.get("NANOFLASH_CUDA_VERBOSE", "0") == "1",
    )
    build_seconds[capability] = time.perf_counter() - start
    return module
