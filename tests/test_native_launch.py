"""The native launch path (attention/flash/native.py, native_launch.cpp; flash_attention.md §9 "Launches without
Python"): from a key's third eager call on, its forward and backward run from C++, and give what the Python path
gives: the same forward bit for bit (the same kernels on the same inputs), gradients within the float64 criterion."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention import attention, attention_qkvpacked
from attention.flash import dispatch, native
from helpers import assert_errors_within, out_and_grads

ROOT = Path(__file__).resolve().parents[1]

# A kernel compiled for sm_90 without a GPU, as Triton's launcher would launch it: its parameter block as native.py
# lays it out (run compiled: Triton decides at import whether it interprets)
LAYOUT = """
import struct, torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from attention.flash import native

@triton.jit
def kernel(X, OUT, n, scale, BLOCK: tl.constexpr):
    pass

source = triton.compiler.ASTSource(fn=kernel, signature=dict(X="*fp32", OUT="*fp32", n="i32", scale="fp32",
                                                             BLOCK="constexpr"), constexprs={(4,): 64})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))

class Bound:  # what a launch.BoundLaunch holds
    compiled, grid, constexprs = compiled, (3, 2, 1), (64,)

x, out, scratch = torch.zeros(10), torch.zeros(2, 4), torch.zeros(16, dtype=torch.uint8)
outputs, buffers, (launch,) = native.make_pass([(Bound, (x, out[1], 7, 0.5))], (x,), (False,), (out,))
_, grid, threads, shared, ctas, pdl, cooperative, block, params, slots = launch
assert grid == [3, 2, 1] and threads == 32 * compiled.metadata.num_warps and ctas == 1, launch
assert params == [0, 8, 16, 20, 24, 32], params  # X, OUT, n, scale, then the two scratch pointers
assert slots == [(False, 0, 0, 0), (False, 8, 1, 16)], slots  # x itself; out's second row (16 bytes in)
assert struct.unpack_from("<if", block, 16) == (7, 0.5) and block[24:40] == bytes(16) and buffers == []
assert native.make_pass([(Bound, (x[1:], out, 7, 0.5))], (x,), (False,), (out,)) is None  # inside a call's tensor
outputs, buffers, _ = native.make_pass([(Bound, (x, scratch[4:].view(torch.float32), 7, 0.5))], (x,), (False,), ())
assert buffers == [16], buffers  # a tensor of the run's own: allocated per call, its whole storage
print("ok")
"""


def test_a_launch_is_laid_out_as_tritons_launcher_passes_it(tmp_path):
    script = tmp_path / "layout.py"  # a @triton.jit kernel must be defined in a file
    script.write_text(LAYOUT)
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


# A stand-in for native_launch.cpp: a module of the same name whose one function records what it was given
STAND_IN = r"""
#include <Python.h>
static PyObject* given = NULL;
static PyObject* set_backward_miss(PyObject* self, PyObject* fn) { Py_XINCREF(fn); given = fn; Py_RETURN_NONE; }
static PyObject* backward_miss(PyObject* self, PyObject* unused) { return Py_NewRef(given ? given : Py_None); }
static PyMethodDef methods[] = {{"set_backward_miss", set_backward_miss, METH_O, ""},
                                {"backward_miss", backward_miss, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "nanoflash_native_launch", NULL, -1, methods};
PyMODINIT_FUNC PyInit_nanoflash_native_launch(void) { return PyModule_Create(&module); }
"""


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_the_build_lands_in_the_cache_and_later_processes_load_it(tmp_path, monkeypatch):
    source = tmp_path / "native_launch.cpp"
    source.write_text(STAND_IN)
    monkeypatch.setattr(native, "SOURCE", source)
    monkeypatch.setattr(native, "_BUILD", native._BUILD.replace("with_cuda=True", "with_cuda=False"))  # no CUDA here
    monkeypatch.setenv("NANOFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_state", {**native._state, "module": None, "child": None})
    native._build()
    built, first_child = native._state["module"], native._state["child"]
    assert built is not None
    monkeypatch.setattr(native, "_backward_miss", lambda *args: ("miss", args))  # autograd.py, imported after the build
    assert built.backward_miss()(1, 2) == ("miss", (1, 2))  # a miss reaches the callback set now
    target = native._built_module()
    assert target.exists() and target.parent.parent == tmp_path / "cache" / "native"
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # the build's own folder is gone
    native._build()  # as a later process: from the cache, no build
    assert native._state["child"] is first_child and native._state["module"] is not None


def test_the_interpreter_keeps_the_python_path():
    if not native.INTERPRET:
        pytest.skip("runs under TRITON_INTERPRET=1 (the CPU tests)")
    assert native.load() is None and native.wait() is None  # nothing built, no thread started
    with native.python_path():
        assert native.load() is None


@pytest.fixture(scope="module")
def extension():
    built = native.wait()
    assert built is not None, "the native launcher did not build (see the warning above)"
    return built


def _kept(extension, q, k, v, causal):
    """Whether the extension keeps a plan for this call's key (asked without running anything of the Python path)."""
    with torch.no_grad():
        return extension.forward(q, k, v, causal, q.shape[-1] ** -0.5) is not None


# (B, Hq, Hkv, T, hs, dtype, causal, NANOFLASH_HOPPER): the tuner's (or the shipped) choices: the `tl` kernels (tiny,
# odd lengths, fp16); on sm_90 "1" takes the Hopper kernels (TMA descriptors among the parameters) where they run
CASES = [(1, 1, 1, 128, 64, torch.bfloat16, True, "auto"), (2, 3, 3, 77, 64, torch.float16, False, "auto"),
         (2, 4, 2, 203, 128, torch.bfloat16, True, "auto"), (4, 12, 12, 1024, 64, torch.bfloat16, True, "auto"),
         (4, 12, 12, 1024, 64, torch.bfloat16, True, "1"), (2, 8, 2, 1023, 128, torch.float16, False, "1")]


@pytest.mark.gpu
@pytest.mark.parametrize("B, Hq, Hkv, T, hs, dtype, causal, hopper", CASES)
def test_native_calls_match_the_python_path_and_float64(extension, monkeypatch, B, Hq, Hkv, T, hs, dtype, causal,
                                                        hopper):
    monkeypatch.setattr(dispatch, "HOPPER_MODE", hopper)
    q = torch.randn(B, T, Hq, hs, device="cuda", dtype=dtype).transpose(1, 2)  # (B, Hq, T, hs) as a model's view
    k, v = (torch.randn(B, T, Hkv, hs, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(2))
    do = torch.randn(q.shape, device="cuda", dtype=dtype)

    def ours(*t):
        return attention(*t, causal=causal, backend="triton")
    for _ in range(2):  # the whole path, then the plan's run that the extension keeps
        out_and_grads(ours, q, k, v, do)
    assert _kept(extension, q, k, v, causal)
    native_run = out_and_grads(ours, q, k, v, do)
    with native.python_path():
        python_run = out_and_grads(ours, q, k, v, do)
    assert torch.equal(native_run[0], python_run[0])
    naive = lambda *t: attention(*t, causal=causal, backend="naive")  # noqa: E731
    exact = out_and_grads(naive, q.double(), k.double(), v.double(), do.double())
    assert_errors_within(("out", "dq", "dk", "dv"), exact, out_and_grads(naive, q, k, v, do), native_run)


@pytest.mark.gpu
def test_packed_calls_write_one_gradient(extension):
    B, T, nh, hs = 2, 333, 4, 64
    qkv = torch.randn(B, T, 3, nh, hs, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(B, nh, T, hs, device="cuda", dtype=torch.bfloat16)

    def run(fn, packed):
        packed = packed.detach().requires_grad_()
        out = fn(packed)
        return out, *torch.autograd.grad(out, packed, do.to(packed.dtype))
    ours = lambda packed: attention_qkvpacked(packed, backend="triton")  # noqa: E731
    for _ in range(2):
        run(ours, qkv)
    with torch.no_grad():
        assert extension.forward_packed(qkv, True, hs ** -0.5) is not None
    native_run = run(ours, qkv)
    naive = lambda packed: attention_qkvpacked(packed, backend="naive")  # noqa: E731
    assert_errors_within(("out", "dqkv"), run(naive, qkv.double()), run(naive, qkv), native_run)


@pytest.mark.gpu
def test_a_new_output_gradient_layout_takes_the_python_path_once(extension):
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    do = torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.float16).transpose(1, 2)  # not out's own layout

    def ours(*t):
        return attention(*t, backend="triton")
    for _ in range(3):
        out_and_grads(ours, q, k, v, torch.randn_like(q))  # forward and backward kept for a contiguous dO
    assert _kept(extension, q, k, v, True)
    naive = lambda *t: attention(*t, backend="naive")  # noqa: E731
    exact = out_and_grads(naive, q.double(), k.double(), v.double(), do.double())
    for _ in range(2):  # the Python path (recorded), then the pass kept for this layout
        assert_errors_within(("out", "dq", "dk", "dv"), exact, out_and_grads(naive, q, k, v, do),
                             out_and_grads(ours, q, k, v, do))


@pytest.mark.gpu
def test_forgetting_the_plans_forgets_the_native_passes(extension):
    q, k, v = (torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    for _ in range(2):
        attention(q, k, v, backend="triton")
    assert _kept(extension, q, k, v, True)
    dispatch.forget_plans()
    assert not _kept(extension, q, k, v, True)
