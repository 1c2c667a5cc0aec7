"""backend="cuda": the CUDA C++ FlashAttention-2 kernels of attention/cuda.

On the CPU (CI): the backend is registered, refuses a machine that cannot run or build it in one line naming what is
missing, and `import attention` does not pull in the compiler tooling; where nvcc is installed, no kernel spills more
than a few values to local memory (ptxas's report). On a GPU (marked gpu, skipped without one):
the output and every gradient against float64 by the criterion of helpers.py, at ragged and odd lengths, Tq != Tk,
GQA, both head dims, both dtypes, causal or not; the first call's build time is printed.
"""
import ast
import itertools
import math
import re
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, assert_matches_fp64, out_and_grads, projection_views, qkv

from attention import attention, available_backends, get_backend
from attention.cuda import build, shared_memory_limit
from attention.cuda.build import CudaBackendUnavailable

# ---------------------------------------------------------------------------------------------------------------------
# CPU


def test_cuda_is_a_registered_backend_without_masks_or_terms():
    assert "cuda" in available_backends()
    spec = get_backend("cuda")
    assert not spec.supports_masks and spec.varlen is None and spec.terms == frozenset() and spec.exact
    assert spec.check_device is not None


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_a_cpu_tensor_is_refused_in_one_line():
    q, k, v = qkv(1, 2, 2, 16, 16, 64)
    with pytest.raises(CudaBackendUnavailable) as err:
        attention(q, k, v, backend="cuda")
    assert isinstance(err.value, ValueError)  # what train.py's device check turns into one line
    assert _one_line(err) == ("the cuda attention kernels run on a CUDA GPU, and this runs on cpu; use a dense backend "
                              "such as sdpa there")
    with pytest.raises(CudaBackendUnavailable):
        get_backend("cuda").check_device(torch.device("cpu"))


@pytest.fixture
def a_gpu_machine(monkeypatch):
    """This process as seen on an sm_90 machine with a CUDA build of torch, nvcc and ninja: tests take one away."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(build, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(build, "_which", lambda tool: f"/usr/bin/{tool}")


def test_a_full_machine_passes_the_check(a_gpu_machine):
    build.check_cuda_device(torch.device("cuda"))


def test_missing_nvcc_is_named(a_gpu_machine, monkeypatch):
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with pytest.raises(CudaBackendUnavailable) as err:
        build.check_cuda_device(torch.device("cuda"))
    message = _one_line(err)
    assert "needs nvcc" in message and "install the CUDA toolkit 12.8" in message and "CUDA_HOME" in message


def test_missing_ninja_is_named(a_gpu_machine, monkeypatch):
    monkeypatch.setattr(build, "_which", lambda tool: None if tool == "ninja" else f"/usr/bin/{tool}")
    with pytest.raises(CudaBackendUnavailable) as err:
        build.check_cuda_device(torch.device("cuda"))
    assert "ninja, which is not on PATH; pip install ninja" in _one_line(err)


def test_a_cpu_only_torch_is_named(a_gpu_machine, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(CudaBackendUnavailable) as err:
        build.check_cuda_device(torch.device("cuda"))
    assert "needs a CUDA build of PyTorch" in _one_line(err)


def test_a_gpu_before_ampere_is_named(a_gpu_machine, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(CudaBackendUnavailable) as err:
        build.check_cuda_device(torch.device("cuda"))
    assert "need an sm_80 or newer GPU" in _one_line(err) and "sm_75" in str(err.value)


def test_only_a_call_imports_the_extension_builder():
    # every module of the package, read: torch.utils.cpp_extension is imported inside a function only (build.py's
    # _load), never when a module is imported
    for path in sorted((ROOT / "attention").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level (including under if / try at module level)
            for inner in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
                if isinstance(inner, ast.ImportFrom) and inner.module and "cpp_extension" in inner.module:
                    pytest.fail(f"{path.relative_to(ROOT)} imports {inner.module} at import time")
                if isinstance(inner, ast.Import) and any("cpp_extension" in a.name for a in inner.names):
                    pytest.fail(f"{path.relative_to(ROOT)} imports cpp_extension at import time")
                if isinstance(inner, ast.ImportFrom) and inner.module == "torch.utils" and any(
                        a.name == "cpp_extension" for a in inner.names):
                    pytest.fail(f"{path.relative_to(ROOT)} imports cpp_extension at import time")
    assert "torch.utils.cpp_extension" in (ROOT / "attention" / "cuda" / "build.py").read_text()


@pytest.mark.slow  # a fresh interpreter's `import attention`: about 5 s of this test's 6 on a CPU machine
def test_importing_attention_needs_no_compiler():
    # a fresh process: importing the package (and the cuda backend's Python side) must not import the extension
    # builder, let alone build anything
    code = ("import sys, attention, attention.cuda; "
            "assert 'torch.utils.cpp_extension' not in sys.modules, 'cpp_extension imported'; "
            "assert not attention.cuda.build.build_seconds")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


SPILL_BUDGET = 128  # bytes of spill stores and loads a kernel may have: a few values (flash_backward.cu)


@pytest.mark.skipif(build.find_nvcc() is None, reason="needs nvcc (the CUDA toolkit); no GPU")
def test_no_kernel_spills_more_than_a_few_values():
    # ptxas's report for every kernel, sm_80 and sm_90, built as build.py builds them: the tiles are sized to 255
    # registers, and a change that spills whole arrays (hundreds of bytes and more) is slow before a GPU test fails
    builds = {(source, arch): subprocess.Popen(
        [build.find_nvcc(), "-c", "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v",
         str(build.HERE / source), "-o", "/dev/null"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for source in ("flash_forward.cu", "flash_backward.cu") for arch in (80, 90)}
    for (source, arch), proc in builds.items():
        report = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, report
        kernels = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores, (\d+) bytes spill loads",
                             report, flags=re.S)
        assert len(kernels) >= 4, report
        for name, stores, loads in kernels:
            assert int(stores) + int(loads) <= SPILL_BUDGET, f"{source} sm_{arch} {name}: {stores} + {loads} bytes"


def test_the_operators_shape_their_outputs_for_torch_compile():
    # torch.compile traces the operators on fake tensors: their fakes must give the kernels' output shapes and dtypes
    from torch._subclasses.fake_tensor import FakeTensorMode

    from attention.cuda import cuda_attention_bwd, cuda_attention_fwd

    with FakeTensorMode():
        q = torch.empty(2, 6, 77, 64, dtype=torch.bfloat16)
        k, v = (torch.empty(2, 3, 90, 64, dtype=torch.bfloat16) for _ in range(2))
        out, lse = cuda_attention_fwd(q, k, v, True, 0.125)
        dq, dk, dv = cuda_attention_bwd(out, q, k, v, out, lse, True, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (2, 6, 77) and lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


# ---------------------------------------------------------------------------------------------------------------------
# GPU

gpu = pytest.mark.gpu
LENGTHS = [(1, 1), (77, 77), (113, 203), (203, 113), (1023, 1024), (1024, 1024)]  # Tq > Tk: rows that see no key


@gpu
def test_first_call_builds_the_extension(capsys):
    start = build.build_seconds.copy()
    module = build.load_extension(torch.device("cuda"))
    assert hasattr(module, "forward") and hasattr(module, "backward")
    capability = torch.cuda.get_device_capability()
    with capsys.disabled():
        took = build.build_seconds[capability]
        print(f"\ncuda attention extension for sm_{capability[0]}{capability[1]}: "
              f"{'built or loaded from the cache' if capability not in start else 'already loaded'} in {took:.1f} s")


@gpu
@pytest.mark.parametrize("Tq, Tk", LENGTHS)
@pytest.mark.parametrize("D, dtype, causal", list(itertools.product((64, 128), (torch.float16, torch.bfloat16),
                                                                    (True, False))))
def test_matches_fp64(Tq, Tk, D, dtype, causal):
    torch.manual_seed(0)
    assert_matches_fp64(*qkv(2, 4, 2, Tq, Tk, D, dtype, device="cuda"), causal=causal, backend="cuda")


@gpu
@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (8, 1), (6, 3)])  # MHA, MQA, a group of 2
@pytest.mark.parametrize("D", [64, 128])
def test_grouped_query_heads(Hq, Hkv, D):
    torch.manual_seed(0)
    assert_matches_fp64(*qkv(2, Hq, Hkv, 333, 333, D, torch.bfloat16, device="cuda"), causal=True, backend="cuda")


@gpu
@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_custom_scale(scale):
    torch.manual_seed(0)
    assert_matches_fp64(*qkv(1, 2, 2, 300, 300, 64, torch.float16, device="cuda"), causal=True, scale=scale,
                        backend="cuda")


@gpu
@pytest.mark.parametrize("rise", [1.0, 5.0, 20.0])  # per 32 keys, in base 2: below, near and past RESCALE_SLACK
@pytest.mark.parametrize("D, causal", [(128, True), (128, False), (64, True)])
def test_scores_that_rise_along_the_keys(rise, D, causal):
    # every row's max grows tile after tile, so at D = 128 the forward's lazy rescale (docs §17) keeps a stale max
    # for some tiles, with probabilities above 1, and moves it for others; D = 64 rescales on every new max
    torch.manual_seed(0)
    q, k, v = qkv(1, 2, 2, 500, 500, D, torch.bfloat16, device="cuda")
    q[..., 0] = 1.0
    per_key = rise / 32 / math.log2(math.e) * math.sqrt(D)  # the score's rise per key, times 1 / scale
    k[..., 0] = per_key * torch.arange(500, device="cuda")
    assert_matches_fp64(q, k, v, causal=causal, backend="cuda")


@gpu
@pytest.mark.parametrize("limit_kib", [100, 128, 164])
@pytest.mark.parametrize("D", [64, 128])
def test_the_tiles_of_gpus_with_less_shared_memory(limit_kib, D):
    # the tiles other GPUs get, on this one: 100 KiB per SM and block (sm_86/89) makes the forward take 32-key tiles
    # at D = 128 and the backward 32-query steps with Q and dO single-buffered (64-query double-buffered at D = 64);
    # 128 KiB double-buffers the 32-query steps; 164 KiB (sm_80) keeps the large steps but not the 64-key forward.
    # Each limit also takes dQ by atomics, where the other tests on sm_90 take the bulk reductions (flash_backward.cu)
    torch.manual_seed(0)
    with shared_memory_limit(limit_kib * 1024):
        assert_matches_fp64(*qkv(2, 4, 2, 203, 203, D, torch.bfloat16, device="cuda"), causal=True, backend="cuda")
        assert_matches_fp64(*qkv(1, 2, 1, 300, 300, D, torch.float16, device="cuda"), causal=False, backend="cuda")


@gpu
def test_kernel_layout_copies_only_what_the_kernels_cannot_read():
    module = build.load_extension(torch.device("cuda"))
    q, k, v = projection_views(2, 37, 4, 64, torch.bfloat16, "cuda")  # strides multiples of 8, last dim contiguous
    assert module.kernel_layout(q) is q
    strided = torch.randn(1, 2, 37, 128, device="cuda", dtype=torch.bfloat16)[..., ::2]  # last dim not contiguous
    assert module.kernel_layout(strided).is_contiguous()
    odd = torch.randn(1 * 2 * 37 * 64 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(1, 2, 37, 64)  # 2 bytes off
    fixed = module.kernel_layout(odd)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, odd)


@gpu
def test_an_eager_call_is_one_cpp_autograd_node():
    # eager calls skip the operators' Python autograd (binding.cpp's AttentionFunction); compiled ones keep the
    # operators (test_torch_compile_fullgraph_matches_eager)
    q, k, v = qkv(1, 2, 2, 64, 64, 64, torch.bfloat16, device="cuda", requires_grad=True)
    out = attention(q, k, v, backend="cuda")
    assert "CppNode" in out.grad_fn.name() and "AttentionFunction" in out.grad_fn.name()


@gpu
def test_views_of_a_fused_projection():
    torch.manual_seed(0)
    q, k, v = projection_views(2, 1000, 6, 128, torch.bfloat16, "cuda")
    assert_matches_fp64(q, k, v, causal=True, backend="cuda")


@gpu
def test_inputs_off_alignment_and_strided_upstream_gradient():
    torch.manual_seed(0)
    aligned = qkv(1, 4, 2, 257, 257, 64, torch.float16, device="cuda")
    shifted = [torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")[1:].view_as(t).copy_(t) for t in aligned]
    assert_matches_fp64(*shifted, causal=True, backend="cuda")
    do = torch.randn(1, 257, 4, 64, dtype=torch.float16, device="cuda").transpose(1, 2)  # not contiguous
    ours = out_and_grads(lambda *t: attention(*t, backend="cuda"), *aligned, do)
    theirs = out_and_grads(lambda *t: attention(*t, backend="sdpa"), *aligned, do)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@gpu
def test_rows_that_see_no_key_are_zero_with_finite_gradients():
    torch.manual_seed(0)
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 200, 50, 64, torch.bfloat16, device="cuda"))
    out = attention(q, k, v, causal=True, backend="cuda")
    out.float().square().sum().backward()
    assert torch.equal(out[:, :, :150], torch.zeros_like(out[:, :, :150]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[:, :, :150], torch.zeros_like(q.grad[:, :, :150]))


@gpu
def test_unsupported_inputs_are_refused_in_one_line():
    q, k, v = qkv(1, 2, 2, 16, 16, 64, torch.float32, device="cuda")
    with pytest.raises(TypeError, match="float16 and bfloat16"):
        attention(q, k, v, backend="cuda")
    q, k, v = qkv(1, 2, 2, 16, 16, 96, torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="head dim 64 or 128, got 96"):
        attention(q, k, v, backend="cuda")


@gpu
def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    q, k, v = qkv(2, 4, 2, 300, 300, 64, torch.bfloat16, "cuda", requires_grad=True)

    def step(q, k, v):
        return attention(q, k, v, causal=True, backend="cuda").float().square().sum()

    eager = torch.autograd.grad(step(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled):  # dQ's float32 atomic adds land in any order: its last bits may differ
        torch.testing.assert_close(a, b)
