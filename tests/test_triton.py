"""The Triton FlashAttention kernel on the CPU, through Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1). Sizes stay tiny: the interpreter runs every program one after the other in
numpy. bfloat16 is left to tests/test_triton_gpu.py: the interpreter's tl.dot cannot do it."""
import re
from pathlib import Path

import pytest
import torch
import triton

from attention import (attention, attention_qkvpacked, causal_mask, triton_flash, triton_hopper,
                       triton_hopper_backward)
from attention.triton_op import flash_attention, flash_attn_bwd, flash_attn_bwd_qkvpacked, flash_attn_fwd

ROOT = Path(__file__).resolve().parents[1]


def out_and_grads(fn, q, k, v, do):
    """fn(q, k, v) and its gradients for the upstream gradient do, on fresh leaves that keep the
    inputs' strides (detach() shares storage), so strided views reach the kernel as views."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def assert_matches_fp64(q, k, v, causal=True, scale=None, **sparse):
    """Forward and dq, dk, dv of the kernel against float64, judged by PyTorch's math attention (the
    naive backend) in the same dtype: err(ours) <= 2 * err(math) + 1e-5 for each of the four.
    sparse: window / document_ids / block_mask, passed to attention() for both.

    err is the max absolute error vs float64: a bug confined to one tile (a wrong mask on the
    diagonal, a ragged edge) shows up in a few elements, which a norm over the tensor dilutes."""
    do = torch.randn(q.shape, dtype=q.dtype, device=q.device)
    exact = out_and_grads(lambda *t: attention(*t, causal, scale, backend="naive", **sparse),
                          q.double(), k.double(), v.double(), do.double())
    math = out_and_grads(lambda *t: attention(*t, causal, scale, backend="naive", **sparse), q, k, v, do)
    if sparse:
        ours = out_and_grads(lambda *t: attention(*t, causal, scale, backend="triton", **sparse), q, k, v, do)
    else:
        ours = out_and_grads(lambda *t: flash_attention(*t, causal, scale), q, k, v, do)
    for name, ref, theirs, mine in zip(("out", "dq", "dk", "dv"), exact, math, ours):
        assert mine.shape == ref.shape and mine.dtype == q.dtype, name
        err_math = (theirs.double() - ref).abs().max().item()
        err_ours = (mine.double() - ref).abs().max().item()
        assert err_ours <= 2 * err_math + 1e-5, f"{name}: error {err_ours:.3g} vs math attention's {err_math:.3g}"


def qkv(B=1, Hq=2, Hkv=2, Tq=37, Tk=37, D=32, dtype=torch.float32, device="cpu"):
    """Fresh random q (B, Hq, Tq, D), k and v (B, Hkv, Tk, D)."""

    def randn(H, T):
        return torch.randn(B, H, T, D, dtype=dtype, device=device)

    return randn(Hq, Tq), randn(Hkv, Tk), randn(Hkv, Tk)


# The interpreter tiles are 32x16 (forward, dQ) and 16x32 (dK/dV): T = 37 and 70 leave ragged last
# tiles, 64 is a whole number of tiles, and causal T >= 37 has tiles before, on and after the diagonal.
@pytest.mark.parametrize(
    "causal, Tq, Tk, D, dtype",
    [
        (True, 37, 37, 40, torch.float16),
        (False, 37, 37, 40, torch.float16),
        (True, 70, 70, 24, torch.float32),
        (False, 70, 70, 24, torch.float32),
        (True, 64, 64, 64, torch.float16),
        (True, 20, 70, 32, torch.float16),  # Tq < Tk: a block of new queries against a longer context
        (False, 33, 65, 16, torch.float32),
        (True, 70, 20, 32, torch.float32),  # Tq > Tk: the first 50 queries see no key
        (False, 65, 33, 16, torch.float16),
        (True, 1, 50, 32, torch.float32),  # one query (decoding) sees every key
    ],
)
def test_matches_fp64(causal, Tq, Tk, D, dtype):
    torch.manual_seed(0)
    assert_matches_fp64(*qkv(Tq=Tq, Tk=Tk, D=D, dtype=dtype), causal=causal)


@pytest.mark.parametrize("Hkv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("causal", [True, False])
def test_grouped_query_attention(Hkv, causal):
    torch.manual_seed(0)
    assert_matches_fp64(*qkv(B=2, Hq=4, Hkv=Hkv, Tq=37, Tk=45, D=16, dtype=torch.float16), causal=causal)


def test_custom_scale():
    torch.manual_seed(0)
    assert_matches_fp64(*qkv(D=24), causal=False, scale=0.7)


def test_fused_qkv_views():
    # q, k, v as the model makes them: split a (B, T, 3C) projection, view heads, transpose
    torch.manual_seed(0)
    B, T, nh, hs = 2, 37, 2, 24
    qkv_proj = torch.randn(B, T, 3 * nh * hs, dtype=torch.float16)
    q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in qkv_proj.split(nh * hs, dim=2))
    assert not q.is_contiguous()
    assert_matches_fp64(q, k, v, causal=True)


def assert_qkvpacked_matches_fp64(qkv_packed, **sparse):
    """attention_qkvpacked on the triton backend: output and the gradient of qkv against float64, judged by
    math attention in the same dtype as assert_matches_fp64 does; -> (out, dqkv) for further checks."""
    do = torch.randn(qkv_packed.shape[0], qkv_packed.shape[3], qkv_packed.shape[1], qkv_packed.shape[4],
                     dtype=qkv_packed.dtype, device=qkv_packed.device)  # (B, nh, T, hs)

    def run(packed, backend):
        packed = packed.detach().requires_grad_()
        out = attention_qkvpacked(packed, backend=backend, **sparse)
        return out, *torch.autograd.grad(out, packed, do.to(packed.dtype))

    exact, math, ours = run(qkv_packed.double(), "naive"), run(qkv_packed, "naive"), run(qkv_packed, "triton")
    for name, ref, theirs, mine in zip(("out", "dqkv"), exact, math, ours):
        assert mine.shape == ref.shape and mine.dtype == qkv_packed.dtype, name
        err_math = (theirs.double() - ref).abs().max().item()
        err_ours = (mine.double() - ref).abs().max().item()
        assert err_ours <= 2 * err_math + 1e-5, f"{name}: error {err_ours:.3g} vs math attention's {err_math:.3g}"
    return ours


@pytest.mark.parametrize("dtype, window", [(torch.float16, None), (torch.float32, None), (torch.float32, (8, 0))])
def test_qkvpacked_matches_fp64_and_the_unpacked_call(dtype, window):
    torch.manual_seed(0)
    B, T, nh, hs = 2, 37, 2, 24
    qkv_packed = torch.randn(B, T, 3, nh, hs, dtype=dtype)  # a fused projection's output, viewed per head
    out, dqkv = assert_qkvpacked_matches_fp64(qkv_packed, window=window)
    # the same kernels as three views through attention(): the same numbers, bit for bit
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in qkv_packed.unbind(2))
    out_views = attention(q, k, v, backend="triton", window=window)
    grads = torch.autograd.grad(out_views, (q, k, v), torch.ones_like(out_views))
    assert torch.equal(out, out_views)
    packed = qkv_packed.detach().requires_grad_()
    dqkv_ones, = torch.autograd.grad(attention_qkvpacked(packed, backend="triton", window=window), packed,
                                     torch.ones_like(out))
    assert torch.equal(dqkv_ones, torch.stack([g.transpose(1, 2) for g in grads], dim=2))


def test_qkvpacked_gradient_is_one_tensor():
    # the backward hands qkv its gradient directly: no unbind (whose backward concatenates) in between
    qkv_packed = torch.randn(1, 20, 3, 2, 16).requires_grad_()
    out = attention_qkvpacked(qkv_packed, backend="triton")
    assert [type(fn).__name__ for fn, _ in out.grad_fn.next_functions] == ["AccumulateGrad"]
    out_naive = attention_qkvpacked(qkv_packed, backend="naive")  # the others take views: autograd concatenates
    assert "AccumulateGrad" not in [type(fn).__name__ for fn, _ in out_naive.grad_fn.next_functions]


def test_qkvpacked_shape_error():
    with pytest.raises(ValueError, match=r"qkv must be \(batch, seq_len, 3, heads, head_dim\), got \(1, 20, 48\)"
                                         r".*view\(B, T, 3, n_head, C // n_head\)"):
        attention_qkvpacked(torch.randn(1, 20, 48), backend="triton")


def test_transposed_views_and_output_layout():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 37, 2, 32).transpose(1, 2) for _ in range(3))  # (B, T, nh, hs) -> (B, nh, T, hs)
    assert_matches_fp64(q, k, v, causal=True)
    out = flash_attention(q, k, v)
    # stored (B, T, nh, hs): the model's y.transpose(1, 2).contiguous().view(B, T, C) is free
    assert out.transpose(1, 2).is_contiguous()


def test_rows_without_keys_are_zero_with_finite_grads():
    torch.manual_seed(0)
    q, k, v = (t.requires_grad_() for t in qkv(Tq=50, Tk=20))
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    out.backward(torch.randn_like(out))
    blind = 50 - 20  # queries 0..29 sit before the first key (bottom-right alignment)
    assert torch.equal(out[:, :, :blind], torch.zeros_like(out[:, :, :blind]))
    assert (out[:, :, blind:] != 0).any()
    assert torch.isinf(lse[:, :, :blind]).all() and (lse[:, :, :blind] > 0).all()
    assert torch.isfinite(lse[:, :, blind:]).all()
    for grad in (q.grad, k.grad, v.grad):
        assert torch.isfinite(grad).all()
    assert torch.equal(q.grad[:, :, :blind], torch.zeros_like(q.grad[:, :, :blind]))


@pytest.mark.parametrize("causal", [True, False])
def test_return_lse(causal):
    torch.manual_seed(0)
    q, k, v = qkv(Tq=37, Tk=45, D=16)
    scale = 0.3
    out, lse = flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    assert lse.shape == (1, 2, 37) and lse.dtype == torch.float32 and not lse.requires_grad
    scores = (q.double() @ k.double().transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(37, 45), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, dim=-1), rtol=0, atol=1e-5)
    assert torch.equal(out, flash_attention(q, k, v, causal=causal, scale=scale))


def assert_bitwise_deterministic(q, k, v):
    """Two forward+backward runs on the same inputs agree bit for bit (no atomics anywhere)."""
    do = torch.randn_like(q)
    first = out_and_grads(flash_attention, q, k, v, do)
    second = out_and_grads(flash_attention, q, k, v, do)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_backward_is_deterministic():
    torch.manual_seed(0)
    assert_bitwise_deterministic(*qkv(Hq=4, Hkv=2, Tq=45, Tk=45, dtype=torch.float16))


@pytest.mark.parametrize("causal, Tq, Tk, D, sparse", [
    (True, 45, 45, 64, {}),
    (False, 37, 70, 40, {}),  # ragged rows, head dim padded: the copy engine zero-fills both
    (True, 70, 37, 32, {"window": (20, 0)}),
])
def test_tensor_descriptor_loads_match_fp64(monkeypatch, causal, Tq, Tk, D, sparse):
    # §9 TMA: the interpreter runs the forward's descriptor loads, which the GPU only takes on Hopper
    monkeypatch.setattr(triton_flash, "TMA_MODE", "1")
    torch.manual_seed(0)
    q, k, v = qkv(Hq=4, Hkv=2, Tq=Tq, Tk=Tk, D=D, dtype=torch.float16)
    assert triton_flash._use_tma(q, k, v)
    assert_matches_fp64(q, k, v, causal=causal, **sparse)


def test_tensor_descriptors_only_for_aligned_layouts(monkeypatch):
    monkeypatch.setattr(triton_flash, "TMA_MODE", "1")
    q = torch.randn(2, 3, 50, 64, dtype=torch.float16)
    assert triton_flash._use_tma(q, q.transpose(1, 2).contiguous().transpose(1, 2))  # any aligned strides
    assert not triton_flash._use_tma(torch.randn(2, 3, 50, 36, dtype=torch.float16))  # 72-byte rows
    assert not triton_flash._use_tma(q.transpose(-1, -2))  # head dim not unit-stride
    assert not triton_flash._use_tma(torch.randn(2 * 3 * 50 * 64 + 1, dtype=torch.float16)[1:].view(2, 3, 50, 64))
    monkeypatch.setattr(triton_flash, "TMA_MODE", "0")
    assert not triton_flash._use_tma(q)


def test_registry_backend_is_this_kernel():
    torch.manual_seed(0)
    q, k, v = qkv()
    assert torch.equal(attention(q, k, v, backend="triton"), flash_attention(q, k, v))


def _bad(D=32, dtype=torch.float32, **changes):
    q, k, v = qkv(D=D, dtype=dtype)
    return {"q": q, "k": k, "v": v, **changes}


@pytest.mark.parametrize(
    "inputs, error, message",
    [
        (_bad(D=8), ValueError, "head_dim 16..256, got 8"),
        (_bad(D=320), ValueError, "head_dim 16..256, got 320"),
        (_bad(dtype=torch.float64), TypeError, "float16, bfloat16 and float32, got torch.float64"),
        (_bad(k=torch.randn(1, 2, 37, 16), v=torch.randn(1, 2, 37, 16)), ValueError, "head_dim 32 but k/v have 16"),
        (_bad(v=torch.randn(1, 2, 37, 32, dtype=torch.float16)), TypeError, "must share one dtype"),
        (_bad(q=torch.randn(1, 3, 37, 32)), ValueError, "multiple of the number of key/value heads"),
        (_bad(k=torch.randn(1, 2, 37, 32, device="meta")), ValueError, "must be on one device"),
        (_bad(scale=-1.0), ValueError, "scale must be a positive number"),
    ],
    ids=["head_dim_small", "head_dim_large", "float64", "head_dims_differ", "dtypes_differ", "heads", "devices", "scale"],
)
def test_bad_input_errors(inputs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        flash_attention(**inputs)


def test_cpu_tensors_without_interpreter_error(monkeypatch):
    monkeypatch.setattr(triton_flash, "INTERPRET", False)
    with pytest.raises(ValueError, match="move tensors to a CUDA device or set TRITON_INTERPRET=1"):
        flash_attention(*qkv())


def test_ops_pass_opcheck():
    # schema, fake-tensor strides vs the real op, AOT dispatch (autograd lives in
    # FlashAttentionFunction, so the ops are checked on inputs that need no grad)
    torch.manual_seed(0)
    q, k, v = qkv(Hq=4, Hkv=2, Tq=20, Tk=24, D=16)
    torch.library.opcheck(flash_attn_fwd, (q, k, v, True, 0.25))
    out, lse = flash_attn_fwd(q, k, v, True, 0.25)
    do = torch.randn_like(out)
    torch.library.opcheck(flash_attn_bwd, (do, q.detach(), k.detach(), v.detach(), out.detach(), lse, True, 0.25))
    qkv_packed = torch.randn(2, 20, 3, 2, 16)
    out, lse = flash_attn_fwd(*(t.transpose(1, 2) for t in qkv_packed.unbind(2)), True, 0.25)
    torch.library.opcheck(flash_attn_bwd_qkvpacked, (torch.randn_like(out), qkv_packed, out, lse, True, 0.25))


def assert_compiled_matches_eager(B, T, nh, hs, dtype, device, tol, packed=False):
    """torch.compile(fullgraph=True) of a model's attention path (fused qkv projection, head views or
    with packed the (B, T, 3, nh, hs) view model.py passes, this kernel, heads merged back) gives eager's
    output and gradients. fullgraph=True fails on any graph break, e.g. an operator without a fake
    implementation."""
    C = nh * hs

    def block(x, w):
        if packed:
            y = attention_qkvpacked((x @ w).view(B, T, 3, nh, hs), backend="triton")
        else:
            q, k, v = (x @ w).split(C, dim=2)
            y = flash_attention(*(t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v)))
        return y.transpose(1, 2).contiguous().view(B, T, C)

    x = torch.randn(B, T, C, dtype=dtype, device=device)
    w = torch.randn(C, 3 * C, dtype=dtype, device=device) * C**-0.5
    do = torch.randn(B, T, C, dtype=dtype, device=device)

    def run(fn):
        x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(x_, w_)
        out.backward(do)
        return out, x_.grad, w_.grad

    for eager, compiled in zip(run(block), run(torch.compile(block, fullgraph=True))):
        torch.testing.assert_close(compiled, eager, rtol=tol, atol=tol)


@pytest.mark.parametrize("packed", [False, True], ids=["views", "packed"])
def test_torch_compile_fullgraph(packed):
    # Inductor compiles the surrounding ops for the CPU; our operator runs the interpreted kernel
    torch.manual_seed(0)
    assert_compiled_matches_eager(1, 20, 2, 16, torch.float32, "cpu", tol=1e-5, packed=packed)


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [16, 40, 64, 80, 128, 160, 256])
def test_hopper_tile_pruning(kernel, dtype, head_dim, monkeypatch):
    # pure Python: every head dim and dtype keeps at least one Hopper config that fits on chip
    monkeypatch.setattr(triton_flash, "INTERPRET", False)  # the GPU's candidate list, not the interpreter's
    block_d = triton.next_power_of_2(head_dim)
    kept = triton_flash.candidate_tiles(kernel, block_d, dtype.itemsize)
    assert kept
    for tile in kept:
        assert tile in triton_flash.HOPPER_TILES[kernel][triton_flash.head_dim_class(block_d)]
        assert triton_flash.smem_bytes(kernel, tile, block_d, dtype.itemsize) <= triton_flash.SMEM_BUDGET


def test_tuned_choices_name_the_kernels_a_call_of_those_sizes_ran(monkeypatch):
    # benchmarks/attention.py records them per cell; a key of other sizes, mask or dtype is not reported
    monkeypatch.setattr(triton_flash, "_best_tile", {})  # what earlier tests tuned is not this test's
    monkeypatch.setattr(triton_flash, "_best_backward", {})
    q, k, v = (torch.randn(1, 2, 40, 24, dtype=torch.float16, requires_grad=True) for _ in range(3))
    assert triton_flash.tuned_choices(24, True, torch.float16, 40, 40) == {}
    attention(q, k, v, causal=True, backend="triton").sum().backward()
    choices = triton_flash.tuned_choices(24, True, torch.float16, 40, 40)
    assert set(choices) == {"fwd", "dq", "dkdv"}  # no "bwd": the Hopper backward is not a candidate here
    assert choices["fwd"][0] == triton_flash.INTERPRETER_TILES["fwd"]
    assert triton_flash.tuned_choices(24, True, torch.float16, 33, 33) == choices  # the same power-of-two bucket
    assert triton_flash.tuned_choices(24, False, torch.float16, 40, 40) == {}
    assert triton_flash.tuned_choices(24, True, torch.float32, 40, 40) == {}
    attention(q, k, v, causal=True, window=(16, 0), backend="triton").sum().backward()  # a window: another key
    assert triton_flash.tuned_choices(24, True, torch.float16, 40, 40) == choices
    # the Hopper backward's choice (only on an H100/H200), whichever its candidate tiles were
    triton_flash._best_backward[triton_flash._BackwardKey(24, True, torch.float16, 64, 64, ((2, False),))] = (2, False)
    assert triton_flash.tuned_choices(24, True, torch.float16, 40, 40) == {**choices, "bwd": (2, False)}
    assert "bwd" not in triton_flash.tuned_choices(24, False, torch.float16, 40, 40)


def test_untuned_launch_takes_the_first_tile_that_fits():
    # NANOFLASH_AUTOTUNE=0: no timing, but a tile the compiler rejects for shared memory is passed over
    tried = []

    def run(tile):
        tried.append(tile)
        if tile == "big":
            raise triton_flash.OutOfResources(300_000, 232_448, "shared memory")
        return f"{tile} launched"

    assert triton_flash._first_that_fits(["big", "small", "smaller"], run) == ("small", "small launched")
    assert tried == ["big", "small"]


def test_tuner_times_each_candidates_repeat_after_a_warmup_of_its_own_in_rotating_rounds(monkeypatch):
    # the forward's tiles and the backward's choice between the `tl` and Hopper kernels share this timing: each
    # candidate's first run (a compile, the whole launch path) returns its repeat, the launch a plan makes, which is
    # what do_bench times, after all have compiled, each after running alone for WARMUP_MS (the GPU's clock settles
    # to the kernel's draw), the very first for HEAT_MS more (from an idle GPU's clock); in ROUNDS rounds, the order
    # rotating, a candidate's time the median of its rounds. A candidate that does not fit in shared memory is
    # infinitely slow and never timed.
    def too_big():
        raise triton_flash.OutOfResources(300_000, 232_448, "shared memory")

    events = []

    def candidate(name):
        def first_run():
            events.append(("compile", name))
            return lambda: name
        return first_run

    measured = {"a": [2.0, 9.0, 3.0], "b": [5.0, 1.0, 6.0]}  # one slow round each: the median ignores it

    def do_bench(repeat, warmup, rep, return_mode):
        events.append((repeat(), warmup, rep))
        return measured[repeat()].pop(0)

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(triton_flash, "ROUNDS", 3)
    times = triton_flash._timed({"a": candidate("a"), "big": too_big, "b": candidate("b")})
    assert times == {"big": float("inf"), "a": 3.0, "b": 5.0}
    warmup, rep = triton_flash.WARMUP_MS, triton_flash.REP_MS
    assert events == [("compile", "a"), ("compile", "b"), ("a", warmup + triton_flash.HEAT_MS, rep), ("b", warmup, rep),
                      ("b", warmup, rep), ("a", warmup, rep), ("a", warmup, rep), ("b", warmup, rep)]
    assert triton_flash._timed({"big": too_big}) == {"big": float("inf")}  # nothing fits: nothing to time


@pytest.mark.parametrize("module, decorator", [(triton_flash, "triton"), (triton_hopper, "gluon"),
                                               (triton_hopper_backward, "gluon")])
def test_doc_and_kernel_point_at_each_other(module, decorator):
    # docs/flash_attention.md cites kernel code as `triton_flash.py:name` (`triton_hopper.py:name`) and the
    # kernels' comments cite the doc's sections as §N; every citation must resolve, and every kernel must be cited
    doc = (ROOT / "docs" / "flash_attention.md").read_text()
    file = Path(module.__file__).name
    code = (ROOT / "attention" / file).read_text()
    cited_names = set(re.findall(rf"`{file}:(\w+)`", doc))
    assert cited_names
    for name in cited_names:
        assert hasattr(module, name), f"docs/flash_attention.md cites missing {file}:{name}"
    jit_functions = set(re.findall(rf"@{decorator}\.jit\n\s*def (\w+)", code))
    assert jit_functions
    assert jit_functions - cited_names == set(), "kernel functions the doc never mentions"
    sections = set(re.findall(r"^## §(\d+)", doc, flags=re.M))
    for number in set(re.findall(r"§(\d+)", code)):
        assert number in sections, f"{file} cites §{number}, which docs/flash_attention.md lacks"
