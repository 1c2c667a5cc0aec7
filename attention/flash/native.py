"""Eager calls without Python per launch (docs/flash_attention.md §9, "Launches without Python").

An eager forward+backward through autograd.Functions spends most of its host time in Python: the Function machinery,
the hand-over of the backward to autograd's thread, Triton's launcher per kernel (docs/perf_notes.md, "Host time").
A dense call of a kept plan (dispatch.py) needs none of it: only its tensors' addresses differ from the call that
made the plan. So native_launch.cpp keeps each plan's launches as *passes* and runs a call of its key as one C++
autograd node: allocate the outputs and buffers, write the addresses into each launch's parameter block, launch.

    module = native.load()            # the built extension, or None (building, off, or no compiler)
    with launch.recording() as record:  # the BoundLaunches a plan's run makes
        ...
    module.add_plan(tensors, causal, scale, native.make_pass(record.launches, ...))   # flash/autograd.py

Where its parameter blocks come from: a BoundLaunch holds the CompiledKernel, whose signature lists every parameter's
type in the order Triton's launcher passes them (constexprs left out, each host tensor descriptor expanded into its
CUtensorMap, then its shape as i32s and strides as i64s, two scratch pointers last). This module lays the first
run's values out in that order; the C++ side fills in the addresses.

It builds when a process first repeats an eager call (torch.utils.cpp_extension with the C++ compiler and ninja, about
a minute, in a child process at low priority; then cached under the tuning store's folder, $NANOFLASH_CACHE_DIR or
~/.cache/nanoflash, per source, torch, CUDA, Python and Triton), in the background: calls take the Python path until it
is ready. NANOFLASH_NATIVE=0 keeps every call on the Python path; a build that fails says so in one line, once, and
the Python path serves.
"""
import atexit
import hashlib
import importlib.util
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import triton

from .device import INTERPRET
from .launch import BoundLaunch, is_descriptor
from .tuning_store import default_cache_dir

SOURCE = Path(__file__).with_name("native_launch.cpp")
MODE = os.environ.get("NANOFLASH_NATIVE", "1")  # "0": every eager call takes the Python path

# Triton's parameter types (CompiledKernel.src.signature) as struct formats: how its launcher passes each scalar
_SCALAR_FORMATS = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "q", "u1": "B", "u8": "B", "u16": "H",
                   "u32": "I", "u64": "Q", "fp16": "e", "fp32": "f", "f32": "f", "fp64": "d"}
# The tensor map's element type: Triton's device-side enum, as its launcher maps it to the driver's (CUtensorMapDataType)
_TMA_DTYPE_DEVICE_TO_HOST = {**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9}
_TMA_TF32 = 11

_state = {"module": None, "thread": None, "child": None, "stopping": False, "off": MODE == "0" or INTERPRET}
_lock = threading.Lock()
# The builder: a child process at low priority (the process it builds for compiles its own kernels first), in a
# folder of its own that is renamed into the cache once built, and stopped when its parent exits: a build cut short
# leaves neither a half-written module nor a lock that would hold up the next process
_BUILD = """
import os, sys
os.nice(10)
from torch.utils.cpp_extension import load
source, build_dir, include = sys.argv[1:]
load(name="nanoflash_native_launch", sources=[source], extra_include_paths=[include], extra_cflags=["-O2"],
     with_cuda=True, build_directory=build_dir, verbose=False)
"""


def python_path_only() -> bool:
    """NANOFLASH_NATIVE=0, the interpreter, or inside python_path(): every call takes the Python path."""
    return _state["off"]


def loaded():
    """The built extension, or None: off (NANOFLASH_NATIVE=0, the interpreter, python_path), not built yet, or
    failed to build (said once)."""
    return None if _state["off"] else _state["module"]


def load():
    """loaded(), and the build started in the background if it has not been: a process's first repeated eager call
    (a plan's run, autograd.py) asks for it, so that a process that makes none never builds it."""
    if _state["off"]:
        return None
    if _state["thread"] is None:
        with _lock:
            if _state["thread"] is None and torch.cuda.is_available():
                _state["thread"] = threading.Thread(target=_build, name="nanoflash-native-build", daemon=True)
                _state["thread"].start()
    return _state["module"]


def wait() -> object:
    """Start the build if needed and wait for it: -> the extension or None (tests, benchmarks)."""
    load()
    thread = _state["thread"]
    if thread is not None:
        thread.join()
    return loaded()


@contextmanager
def python_path():
    """Calls inside the block take the Python path (tests and benchmarks set the two side by side)."""
    off, _state["off"] = _state["off"], True
    try:
        yield
    finally:
        _state["off"] = off


def _built_module() -> Path:
    """Where this source's build lives for this torch, CUDA, Python and Triton (whose cuda.h it includes)."""
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), torch.__version__.encode(), str(torch.version.cuda).encode(),
                                      sys.version.encode(), triton.__version__.encode()])).hexdigest()[:16]
    return default_cache_dir() / "native" / key / "nanoflash_native_launch.so"


def _build() -> None:
    try:
        target = _built_module()
        if not target.exists():
            _compile(target)
        spec = importlib.util.spec_from_file_location("nanoflash_native_launch", target)
        built = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(built)
        built.set_backward_miss(_backward_miss_now)
        _state["module"] = built
    except Exception as error:  # noqa: BLE001 - any build failure leaves the Python path, which needs none of it
        if _state["stopping"]:  # the process is exiting and stopped the build: nothing to say
            return
        lines = str(error).strip().splitlines() or [type(error).__name__]
        warnings.warn(f"nanoflash: eager calls keep the Python launch path (more host time per call): the native "
                      f"launcher did not build ({lines[-1][:200]}); NANOFLASH_NATIVE=0 skips the attempt", stacklevel=1)


def _compile(target: Path) -> None:
    """Build the extension into target (torch.utils.cpp_extension: a C++ compiler and ninja, ~1 minute)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"  # cuda.h, as Triton's launcher takes it
    with tempfile.TemporaryDirectory(dir=target.parent) as build_dir:
        child = subprocess.Popen([sys.executable, "-c", _BUILD, str(SOURCE), build_dir, str(include)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        _state["child"] = child
        output, _ = child.communicate()
        if child.returncode != 0:
            raise RuntimeError((output.strip().splitlines() or ["the build failed"])[-1])
        os.replace(Path(build_dir) / target.name, target)  # one folder: the rename is atomic


@atexit.register
def _stop_build() -> None:
    _state["stopping"] = True
    child = _state["child"]
    if child is not None and child.poll() is None:
        os.killpg(child.pid, signal.SIGTERM)  # the builder and its compilers


# the Python side of a backward that has no pass yet: autograd.py sets it (native_backward_miss) at its import
_backward_miss = None


def set_backward_miss(fn) -> None:
    global _backward_miss
    _backward_miss = fn


def _backward_miss_now(*args):
    """What the extension calls on a miss: the callback set now, so a build that loads before autograd.py's import
    (wait() from a benchmark, a test's fixture) still reaches it."""
    return _backward_miss(*args)


def forget() -> None:
    """Drop every kept pass (dispatch.forget_plans: a setting the plans bind changed)."""
    if _state["module"] is not None:
        _state["module"].forget()


class _Roots:
    """The tensors a pass's parameters point into: the call's (given), its outputs, then buffers the recorded run
    allocated (any tensor in none of the others' storage). A call's tensor must be met at its own address; an
    output, or a packed qkv, may be met inside (q, k and v views, dq, dk and dv slices), at a fixed offset."""

    def __init__(self, given: tuple, inside: tuple[bool, ...], outputs: tuple):
        self.tensors = [*given, *outputs]
        self.inside = [*inside, *(True,) * len(outputs)]
        self.buffers: dict[int, int] = {}  # a buffer's storage address -> its root
        self.buffer_bytes: list[int] = []

    def place(self, t: torch.Tensor) -> tuple[int, int] | None:
        """-> (root, byte offset) of t's address, or None where it cannot be told apart from a call's tensor."""
        address = t.data_ptr()
        for root, known in enumerate(self.tensors):
            if known.data_ptr() == address:
                return root, 0
        storage = t.untyped_storage().data_ptr()
        for root, known in enumerate(self.tensors):
            if known.untyped_storage().data_ptr() == storage:
                return (root, address - known.data_ptr()) if self.inside[root] else None
        if storage not in self.buffers:
            self.buffers[storage] = len(self.tensors) + len(self.buffer_bytes)
            self.buffer_bytes.append(t.untyped_storage().nbytes())
        return self.buffers[storage], address - storage


def _aligned(block: bytearray, size: int) -> int:
    block.extend(b"\0" * (-len(block) % size))
    return len(block)


def _tensor_map(desc, meta: dict, place: tuple[int, int], index: int) -> tuple:
    """A slot of the tensor map Triton's launcher encodes for host descriptor desc (its fill_tma_descriptor)."""
    shape = list(desc.shape)
    if meta.get("fp4_padded"):
        shape[-1] *= 2
    elem_type = _TMA_TF32 if getattr(desc, "round_f32_to_tf32", False) else _TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]]
    strides = [stride * meta["elem_size"] for stride in desc.strides[:-1]]
    return (True, index, *place, elem_type, meta["swizzle"], int(desc.padding == "nan"), shape[::-1], strides[::-1],
            list(meta["block_size"])[::-1])


def _launch(bound: BoundLaunch, args: tuple, roots: _Roots) -> tuple | None:
    """One recorded launch as the tuple native_launch.cpp's launch_of takes, or None where it cannot run there."""
    compiled = bound.compiled
    meta = compiled.metadata
    if meta.global_scratch_size or meta.profile_scratch_size or len(meta.tensordesc_meta or ()) > 16:
        return None
    values = (*args, *bound.constexprs)
    signature = list(compiled.src.signature.values())
    if len(values) != len(signature):
        return None
    block, params, slots = bytearray(), [], []
    maps = iter(meta.tensordesc_meta or ())

    def scalar(kind: str, value) -> None:
        fmt = _SCALAR_FORMATS[kind]
        params.append(_aligned(block, struct.calcsize(fmt)))
        block.extend(struct.pack(fmt, value))
    for kind, value in zip(signature, values):
        if kind == "constexpr":
            continue
        if kind.startswith("*"):
            place = roots.place(value) if isinstance(value, torch.Tensor) else None
            if place is None:
                return None
            params.append(_aligned(block, 8))
            slots.append((False, params[-1], *place))
            block.extend(bytes(8))
        elif kind.startswith("tensordesc"):
            meta_of_desc = next(maps, None)
            place = roots.place(value.base) if is_descriptor(value) and meta_of_desc is not None else None
            if place is None:
                return None
            index = sum(1 for slot in slots if slot[0])
            slots.append(_tensor_map(value, meta_of_desc, place, index))
            params.append(-1 - index)
            for size in value.shape:
                scalar("i32", size)
            for stride in value.strides:
                scalar("i64", stride)
        elif kind in _SCALAR_FORMATS:
            scalar(kind, value)
        else:
            return None
    scalar("u64", 0)  # the global scratch pointer: none (checked above)
    scalar("u64", 0)  # the profile scratch pointer: none
    grid = [int(n) for n in bound.grid]
    return (compiled.function, grid, 32 * meta.num_warps, meta.shared, meta.num_ctas, bool(meta.launch_pdl),
            bool(meta.launch_cooperative_grid), bytes(block), params, slots)


def make_pass(launches: list, given: tuple, inside: tuple[bool, ...], outputs: tuple) -> tuple | None:
    """The pass (module.add_plan's and add_backward's argument) for a plan's recorded launches, (BoundLaunch, args)
    pairs: given the call's tensors (inside: which may be met at an offset, a packed qkv) and its outputs. None
    where a launch cannot run from C++ (scratch memory, a parameter that is not one of these tensors or a number)."""
    roots = _Roots(given, inside, outputs)
    tuples = [_launch(bound, args, roots) for bound, args in launches]
    if not tuples or any(t is None for t in tuples):
        return None
    return list(outputs), roots.buffer_bytes, tuples
