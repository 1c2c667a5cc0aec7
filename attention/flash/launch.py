"""Launching a Triton kernel with less host time than `kernel[grid](*args)` (docs/perf_notes.md, "Host time").

Triton compiles a kernel once per *specialisation* of its arguments: each tensor's dtype and whether its address is a
multiple of 16 bytes, each integer's being 1 or a multiple of 16, each descriptor's dtype, block and layout, and the
constexprs. `kernel[grid](*args)` works that out from every argument on every call, looks the variant up and only then
launches: at small shapes such as GPT-2's, an eager call could take longer to issue than to run.

`launch` keeps each compiled variant under a *launch key* made of the same facts taken finer: the integers' values
themselves (not just "1" or "a multiple of 16"), each tensor's dtype and 16-byte alignment, each descriptor's dtype,
alignment, block, layout, shape and strides, the constexprs, the launch options, the grid and the device. Two calls
with one key therefore have one specialisation, and a key seen before launches its compiled kernel directly
(CompiledKernel[grid]); a new key goes through kernel[grid], which compiles the variant or finds it in Triton's
cache. Floats (the softmax scale) are never specialised and stay out of the key. Under the CPU interpreter there is
no compiled kernel to keep: every call goes through kernel[grid].

Working out the key still costs host time (~45 arguments, descriptors among them). A caller that already knows its
next calls specialise as this one did (dispatch.py's launch plans: same shapes, strides, dtype and alignment) skips
it: launch returns `again`, which launches the same compiled kernel on new arguments without a key, and `planned`
turns the first call's arguments into a plan whose per-call work is filling the inputs' places. `recording` lists the
launches a plan's run makes, which native.py keeps as a pass that C++ launches without Python (§9).
"""
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import NamedTuple

import torch

from .device import INTERPRET

_PLAIN = (int, str, type(None))  # arguments that are their own key (not bool: True == 1 in a key, not to Triton)
MAX_KEYS = 4096  # forget every kept launch past this many (a run over ever-new shapes); each costs one bind again


class Launched(NamedTuple):
    """What a launch leaves behind: the compiled kernel (its registers, spills, PTX; under the interpreter whatever
    kernel[grid] returned) and again(*args), the same launch on new arguments that specialise as the first ones did."""
    compiled: object
    again: Callable


# launch key -> the Launched of its first launch
_launches: dict[tuple, Launched] = {}


def remember(cache: dict, key, value) -> None:
    """cache[key] = value, forgetting everything past MAX_KEYS entries (a run over ever-new shapes)."""
    if len(cache) >= MAX_KEYS:
        cache.clear()
    cache[key] = value


def _arg_key(arg):
    """What of one argument decides Triton's specialisation (module docstring), hashable."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, float):
        return float
    if isinstance(arg, bool):
        return bool, arg
    # a host-side tensor descriptor (Gluon's TensorDescriptor, a mutable dataclass, so not hashable itself)
    return (arg.base.dtype, arg.base.data_ptr() % 16 == 0, tuple(arg.block_shape), arg.layout, tuple(arg.shape),
            tuple(arg.strides))


def launch_key(fn, device: int, grid: tuple, args: tuple, constants: dict) -> tuple:
    """The key two launches of fn share only if Triton would run the same compiled variant for both."""
    return (fn, device, grid, tuple(constants.items()), tuple(arg if type(arg) in _PLAIN else _arg_key(arg)
                                                               for arg in args))


def launch(fn, grid: tuple, args: tuple, **constants) -> Launched:
    """fn[grid](*args, **constants): the kernel's positional arguments, then its constexprs and the launch options
    (num_warps, num_stages, maxnreg) by name. -> Launched: the compiled kernel and the launch to repeat."""
    _not_a_plan()
    if INTERPRET:
        return Launched(fn[grid](*args, **constants), lambda *args: fn[grid](*args, **constants))
    key = launch_key(fn, torch.cuda.current_device(), grid, args, constants)
    kept = _launches.get(key)
    if kept is not None:
        kept.again(*args)
        return kept
    compiled = fn[grid](*args, **constants)
    # CompiledKernel[grid] takes every parameter positionally, the constexprs too (or their defaults)
    constexprs = tuple(constants.get(param.name, param.default) for param in fn.params[len(args):])
    kept = Launched(compiled, BoundLaunch(compiled, tuple(grid) + (1,) * (3 - len(grid)), args, constexprs))
    remember(_launches, key, kept)
    return kept


def planned(again: Callable, first_args: tuple, inputs: tuple) -> Callable | None:
    """-> run(*values): again(*first_args) with each place that held inputs[i] (or a descriptor of it) taking values[i]:
    a launch plan whose per-call work is the inputs' places alone (dispatch.py). None where two inputs are one object
    (the first call cannot tell their places apart); an input that is None keeps its places' None. The plan keeps no
    input of the first call alive."""
    given = [(id(x), i) for i, x in enumerate(inputs) if x is not None]  # a None stays the first call's None
    where = dict(given)
    if len(where) < len(given):
        return None
    places = [(j, where[id(arg.base if is_descriptor(arg) else arg)]) for j, arg in enumerate(first_args)
              if id(arg.base if is_descriptor(arg) else arg) in where]
    filled = {j for j, _ in places}
    template = [None if j in filled else arg for j, arg in enumerate(first_args)]

    def run(*values):
        args = template.copy()
        for j, i in places:
            args[j] = values[i]
        again(*args)
    return run


def is_descriptor(arg) -> bool:
    """A host-side tensor descriptor (Gluon's or Triton's TensorDescriptor): the tensor it reads is its base."""
    return hasattr(arg, "block_shape") and hasattr(arg, "base")


def rebased(desc, t: torch.Tensor | None):
    """desc reading t instead: for a tensor of desc's dtype, shape, strides and alignment (a launch key or a plan key
    promises them), without the checks a descriptor's construction runs (host time on every call), which desc
    already passed. t None: a template that keeps no tensor alive."""
    aimed = type(desc).__new__(type(desc))  # a shallow copy without __init__'s checks, and without copy.copy's pickling
    aimed.__dict__.update(desc.__dict__)  # protocol, which costs more host time than the copy itself
    aimed.base = t
    return aimed


class Recording:
    """The launches one run of a launch plan makes, in order: (BoundLaunch, its arguments) pairs (native.py keeps them
    as a pass). planned: False where the run took the whole path (a launch through `launch`: compiling, tuning), whose
    launches a later call does not repeat."""

    def __init__(self):
        self.launches: list[tuple["BoundLaunch", tuple]] = []
        self.planned = True


_recorder = threading.local()  # .current: the Recording of this thread's run, if one is being recorded


@contextmanager
def recording(on: bool = True):
    """Record the launches made on this thread inside the block: -> the Recording (None, recording nothing, where
    not on)."""
    if not on:
        yield None
        return
    record = _recorder.current = Recording()
    try:
        yield record
    finally:
        _recorder.current = None


def _not_a_plan() -> None:
    record = getattr(_recorder, "current", None)
    if record is not None:
        record.planned = False


class BoundLaunch:
    """One compiled kernel on one grid (CompiledKernel[grid]), launched again on new arguments that specialise as the
    first call's did. A descriptor's place may take the tensor it reads instead: the descriptor is re-aimed at it
    (its layout, block, shape and strides are the first call's there), so a plan keeps no tensor of its first call."""

    def __init__(self, compiled, grid: tuple, first_args: tuple, constexprs: tuple):
        self.compiled, self.grid, self.constexprs = compiled, grid, constexprs
        self.templates = {i: rebased(arg, None) for i, arg in enumerate(first_args) if is_descriptor(arg)}
        self.runner = compiled[grid]

    def __call__(self, *args):
        if self.templates:
            args = list(args)
            for i, template in self.templates.items():
                if isinstance(args[i], torch.Tensor):
                    args[i] = rebased(template, args[i])
        record = getattr(_recorder, "current", None)
        if record is not None:
            record.launches.append((self, tuple(args)))
        self.runner(*args, *self.constexprs)
