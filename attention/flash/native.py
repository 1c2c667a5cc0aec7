"""Eager calls without Python per launch (docs/flash_attention.md §9, "Launches without Python").

An eager forward+backward through autograd.Functions spends most of its host time in Python: the Function machinery,
the hand-over of the backward to autograd's thread, Triton's launcher per kernel (docs/perf_notes.md, "Host time").
A dense call of a kept plan (dispatch.py) needs none of it: only its tensors' addresses differ from the call that
made the plan. So native_launch.cpp keeps each plan's launches as *passes* and runs a call of its key as one C++
autograd node: allocate the outputs and buffers, write the addresses into each launch's parameter block, launch.

    module = native.module()          # the built extension, or None (still building, off, or no compiler)
    with recording() as launches:     # launch.py: the BoundLaunches a plan's run makes
        ...
    native.forward_pass(...), native.backward_pass(...) -> the pass tuples module.add_plan / add_backward take

Where its parameter blocks come from: a BoundLaunch holds the CompiledKernel, whose signature lists every parameter's
type in the order Triton's launcher passes them (constexprs left out, each host tensor descriptor expanded into its
CUtensorMap, then its shape as i32s and strides as i64s, two scratch pointers last). This module lays the first
run's values out in that order; the C++ side fills in the addresses.

It builds on the first eager call of a process (torch.utils.cpp_extension, ~30-60 s with a C++ compiler, then cached
on disk), in a background thread: calls take the Python path until it is ready. NANOFLASH_NATIVE=0 keeps every call
on the Python path; a build that fails says so in one line, once, and the Python path serves.
"""
import os
import struct
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import triton

from .device import INTERPRET
from .launch import BoundLaunch, is_descriptor

SOURCE = Path(__file__).with_name("native_launch.cpp")
MODE = os.environ.get("NANOFLASH_NATIVE", "1")  # "0": every eager call takes the Python path

# Triton's parameter types (CompiledKernel.src.signature) as struct formats: how its launcher passes each scalar
_SCALAR_FORMATS = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "q", "u1": "B", "u8": "B", "u16": "H",
                   "u32": "I", "u64": "Q", "fp16": "e", "fp32": "f", "f32": "f", "fp64": "d"}
# The tensor map's element type: Triton's device-side enum, as its launcher maps it to the driver's (CUtensorMapDataType)
_TMA_DTYPE_DEVICE_TO_HOST = {**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9}
_TMA_TF32 = 11

_state = {"module": None, "thread": None, "off": MODE == "0" or INTERPRET}
_lock = threading.Lock()


def module():
    """The built extension, or None: off (NANOFLASH_NATIVE=0, the interpreter, no CUDA, python_path), still building
    in the background (started by the first call), or failed to build (said once)."""
    if _state["off"]:
        return None
    built = _state["module"]
    if built is None and _state["thread"] is None:
        with _lock:
            if _state["thread"] is None and torch.cuda.is_available():
                _state["thread"] = threading.Thread(target=_build, name="nanoflash-native-build", daemon=True)
                _state["thread"].start()
    return built


def wait() -> object:
    """Start the build if needed and wait for it: -> the extension or None (tests, benchmarks)."""
    module()
    thread = _state["thread"]
    if thread is not None:
        thread.join()
    return _state["module"]


@contextmanager
def python_path():
    """Calls inside the block take the Python path (tests and benchmarks set the two side by side)."""
    off, _state["off"] = _state["off"], True
    try:
        yield
    finally:
        _state["off"] = off


def _build() -> None:
    try:
        from torch.utils.cpp_extension import load  # here: only a process with eager GPU calls needs it

        nvidia = Path(triton.__file__).parent / "backends" / "nvidia" / "include"  # cuda.h, as Triton's launcher
        built = load(name="nanoflash_native_launch", sources=[str(SOURCE)], extra_include_paths=[str(nvidia)],
                     extra_cflags=["-O2"], with_cuda=True, verbose=False)
        built.set_backward_miss(_backward_miss)
        _state["module"] = built
    except Exception as error:  # noqa: BLE001 - any build failure leaves the Python path, which needs none of it
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        warnings.warn(f"nanoflash: eager calls keep the Python launch path (more host time per call): the native "
                      f"launcher did not build ({reason[:200]}); NANOFLASH_NATIVE=0 skips the attempt", stacklevel=1)


# the Python side of a backward that has no pass yet: autograd.py sets it (native_backward_miss)
_backward_miss = None


def set_backward_miss(fn) -> None:
    global _backward_miss
    _backward_miss = fn
    if _state["module"] is not None:
        _state["module"].set_backward_miss(fn)


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
