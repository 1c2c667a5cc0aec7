"""The Triton FlashAttention kernel on the CPU, through Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1). Sizes stay tiny: the interpreter runs every program one after the other in
numpy. bfloat16 is left to tests/test_triton_gpu.py: the interpreter's tl.dot cannot do it."""
import importlib
import re

import pytest
import torch
from helpers import (ROOT, assert_bitwise_deterministic, assert_compiled_matches_eager, assert_matches_fp64,
                     assert_qkvpacked_matches_fp64, packed_qkv, projection_views, qkv)

from attention import attention, attention_qkvpacked, causal_mask
from attention.flash import dispatch
from attention.flash import device
from attention.inputs import unpack_qkv
from attention.flash.autograd import (flash_attention, flash_attn_bwd, flash_attn_bwd_qkvpacked, flash_attn_fwd,
                                      flash_attn_fwd_qkvpacked)


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
    q, k, v = projection_views(2, 37, 2, 24, torch.float16)
    assert not q.is_contiguous()
    assert_matches_fp64(q, k, v, causal=True)


@pytest.mark.parametrize("dtype, window", [(torch.float16, None), (torch.float32, None), (torch.float32, (8, 0))])
def test_qkvpacked_matches_fp64_and_the_unpacked_call(dtype, window):
    torch.manual_seed(0)
    qkv_packed = packed_qkv(2, 37, 2, 24, dtype)  # a fused projection's output, viewed per head
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
    qkv_packed = packed_qkv(1, 20, 2, 16).requires_grad_()
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
    # stored (B, T, nh, hs), viewed (B, nh, T, hs)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv(Tq=37, Tk=37, D=32))
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
    monkeypatch.setattr(dispatch, "TMA_MODE", "1")
    torch.manual_seed(0)
    q, k, v = qkv(Hq=4, Hkv=2, Tq=Tq, Tk=Tk, D=D, dtype=torch.float16)
    assert dispatch.use_tma(q, k, v)
    assert_matches_fp64(q, k, v, causal=causal, **sparse)


def test_tensor_descriptors_only_for_aligned_layouts(monkeypatch):
    monkeypatch.setattr(dispatch, "TMA_MODE", "1")
    q, k, _ = qkv(2, 3, 3, 50, 50, 64, torch.float16)
    assert dispatch.use_tma(q, k.transpose(1, 2).contiguous().transpose(1, 2))  # any aligned strides
    assert not dispatch.use_tma(qkv(2, 3, 3, 50, 50, 36, torch.float16)[0])  # 72-byte rows
    assert not dispatch.use_tma(q.transpose(-1, -2))  # head dim not unit-stride
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view_as(q).copy_(q)  # start 2 bytes off alignment
    assert not dispatch.use_tma(shifted)
    monkeypatch.setattr(dispatch, "TMA_MODE", "0")
    assert not dispatch.use_tma(q)


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
        (_bad(D=8), ValueError, "the triton attention kernels support head_dim 16..256, got 8"),
        (_bad(D=320), ValueError, "the triton attention kernels support head_dim 16..256, got 320"),
        (_bad(dtype=torch.float64), TypeError,
         "the triton attention kernels support float16, bfloat16 and float32, got torch.float64"),
        (_bad(k=qkv(D=16)[1], v=qkv(D=16)[2]), ValueError, "head_dim 32 but k has 16"),
        (_bad(v=qkv(dtype=torch.float16)[2]), TypeError, "must share one dtype"),
        (_bad(q=qkv(Hq=3)[0]), ValueError, "multiple of the number of key/value heads"),
        (_bad(k=qkv()[1].to("meta")), ValueError, "must be on one device"),
        (_bad(scale=-1.0), ValueError, "scale must be a positive number"),
    ],
    ids=["head_dim_small", "head_dim_large", "float64", "head_dims_differ", "dtypes_differ", "heads", "devices", "scale"],
)
def test_bad_input_errors(inputs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        flash_attention(**inputs)


def test_cpu_tensors_without_interpreter_error(monkeypatch):
    monkeypatch.setattr(device, "INTERPRET", False)  # what check_triton_support reads
    with pytest.raises(ValueError, match="the triton attention kernels run on .*cpu.*TRITON_INTERPRET=1"):
        flash_attention(*qkv())


def test_bfloat16_in_the_interpreter_is_refused_in_one_line():
    # Triton's CPU interpreter gets bf16 products wrong: refused, with what works instead
    with pytest.raises(TypeError, match=r"interpreter \(TRITON_INTERPRET=1\) computes bfloat16 products wrong.*float16 "
                                        r"or float32 on the CPU"):
        attention(*qkv(dtype=torch.bfloat16), backend="triton")


def test_ops_pass_opcheck():
    # schema, fake-tensor strides vs the real op, AOT dispatch, and the forward ops' registered autograd (on inputs
    # that need grad)
    torch.manual_seed(0)
    q, k, v = qkv(Hq=4, Hkv=2, Tq=20, Tk=24, D=16)
    torch.library.opcheck(flash_attn_fwd, (q, k, v, True, 0.25))
    out, lse = flash_attn_fwd(q, k, v, True, 0.25)
    do = torch.randn_like(out)
    torch.library.opcheck(flash_attn_bwd, (do, q.detach(), k.detach(), v.detach(), out.detach(), lse, True, 0.25))
    qkv_packed = packed_qkv(2, 20, 2, 16)
    torch.library.opcheck(flash_attn_fwd_qkvpacked, (qkv_packed.requires_grad_(), True, 0.25))
    out, lse = flash_attn_fwd_qkvpacked(qkv_packed.detach(), True, 0.25)
    torch.library.opcheck(flash_attn_bwd_qkvpacked, (torch.randn_like(out), qkv_packed.detach(), out, lse, True, 0.25))


@pytest.mark.parametrize("packed", [False, True], ids=["views", "packed"])
def test_the_ops_autograd_gives_the_functions_gradients(packed):
    # torch.compile's way in (the ops' registered autograd) against eager's (the autograd.Functions)
    torch.manual_seed(0)
    qkv_packed = packed_qkv(2, 21, 2, 16).requires_grad_()
    q, k, v = unpack_qkv(qkv_packed)
    do = torch.randn(2, 2, 21, 16)
    if packed:
        through_op = flash_attn_fwd_qkvpacked(qkv_packed, True, 0.25)[0]
    else:
        through_op = flash_attn_fwd(q, k, v, True, 0.25)[0]
    eager = attention_qkvpacked(qkv_packed, scale=0.25, backend="triton")
    for a, b in zip(torch.autograd.grad(through_op, qkv_packed, do), torch.autograd.grad(eager, qkv_packed, do)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("packed", [False, True], ids=["views", "packed"])
def test_compiled_graphs_are_kept_by_aot_autograds_cache(packed):
    # a compiled graph holds operator calls, no autograd.Function, which AOTAutograd's cache leaves out: a new
    # process then finds the traced forward and backward on disk instead of tracing the model again
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache
    counters.clear()
    with fresh_cache():
        for _ in range(2):
            torch._dynamo.reset()  # as a new process: only what is on disk remains
            assert_compiled_matches_eager(1, 20, 2, 16, torch.float32, "cpu", tol=1e-5, packed=packed)
    assert counters["aot_autograd"]["autograd_cache_bypass"] == 0
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1


@pytest.mark.parametrize("packed", [False, True], ids=["views", "packed"])
def test_torch_compile_fullgraph(packed):
    # Inductor compiles the surrounding ops for the CPU; our operator runs the interpreted kernel
    torch.manual_seed(0)
    assert_compiled_matches_eager(1, 20, 2, 16, torch.float32, "cpu", tol=1e-5, packed=packed)


KERNEL_FILES = ["flash/tl_tiles.py", "flash/tl_forward.py", "flash/tl_backward.py", "flash/hopper/gluon_common.py",
                "flash/hopper/gluon_forward.py", "flash/hopper/gluon_softmax.py", "flash/hopper/gluon_backward.py",
                "flash/hopper/gluon_dq.py", "flash/hopper/gluon_query_tile.py", "flash/hopper/gluon_dropout.py",
                "flash/hopper/backward.py", "moba/hopper.py"]


def _module(path: str):
    """attention/<path> as a module: flash/tl_forward.py -> attention.flash.tl_forward"""
    return importlib.import_module("attention." + path.removesuffix(".py").replace("/", "."))


@pytest.mark.parametrize("file", KERNEL_FILES)
def test_doc_and_kernel_point_at_each_other(file):
    # docs/flash_attention.md cites kernel code as `flash/tl_forward.py:name` (`flash/hopper/gluon_forward.py:name`,
    # ...) and the kernels' comments cite the doc's sections as §N; every citation must resolve, and every kernel (a
    # @triton.jit or @gluon.jit function) must be cited
    doc = (ROOT / "docs" / "flash_attention.md").read_text()
    module = _module(file)
    code = (ROOT / "attention" / file).read_text()
    cited_names = set(re.findall(rf"`{re.escape(file)}:(\w+)`", doc))
    assert cited_names
    for name in cited_names:
        assert hasattr(module, name), f"docs/flash_attention.md cites missing {file}:{name}"
    jit_functions = set(re.findall(r"@(?:triton|gluon)\.jit\n\s*def (\w+)", code))
    assert jit_functions
    assert jit_functions - cited_names == set(), "kernel functions the doc never mentions"
    sections = set(re.findall(r"^## §(\d+)", doc, flags=re.M))
    cited_sections = set(re.findall(r"§(\d+)", code))
    assert cited_sections
    assert cited_sections - sections == set(), f"{file} cites sections docs/flash_attention.md lacks"


def test_every_code_citation_in_the_doc_resolves():
    # besides the kernels: the dispatch, tuner, MoBA and other modules the doc cites as `path.py:name`
    doc = (ROOT / "docs" / "flash_attention.md").read_text()
    cited = set(re.findall(r"`([\w/]+\.py):(\w+)`", doc))
    assert {"flash/dispatch.py", "flash/tuner.py"} <= {file for file, _ in cited}
    missing = []
    for file, name in sorted(cited):
        assert (ROOT / "attention" / file).is_file(), f"docs/flash_attention.md cites attention/{file}"
        if not hasattr(_module(file), name):
            missing.append(f"{file}:{name}")
    assert missing == [], "docs/flash_attention.md cites names the code lacks"
