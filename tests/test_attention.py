"""The reference backends agree with each other and with a float64 reference; bad input fails clearly."""
import pytest
import torch

from attention import Attention, attention, available_backends, causal_mask, register_backend

REFERENCE_BACKENDS = ["naive", "compile", "sdpa"]


def _qkv(B=2, Hq=4, Hkv=4, Tq=33, Tk=33, D=16, dtype=torch.float32):
    q = torch.randn(B, Hq, Tq, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Tk, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Tk, D, dtype=dtype, requires_grad=True)
    return q, k, v


def _forward_backward(backend, q, k, v, causal, scale=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, causal=causal, scale=scale, backend=backend)
    out.backward(torch.ones_like(out) * 0.5 + torch.arange(out.shape[-1], dtype=out.dtype) * 0.01)
    return out.detach(), q.grad, k.grad, v.grad


def test_causal_mask_is_bottom_right_aligned():
    assert torch.equal(causal_mask(3, 3), torch.ones(3, 3, dtype=torch.bool).tril())
    # 2 new queries against 4 cached keys: they sit at positions 2 and 3
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]
    # more queries than keys: the first query sees nothing
    assert causal_mask(3, 2).tolist() == [[False, False], [True, False], [True, True]]


@pytest.mark.parametrize("backend", REFERENCE_BACKENDS)
@pytest.mark.parametrize(
    "shape",
    [
        dict(Tq=33, Tk=33, Hkv=4),  # odd T
        dict(Tq=5, Tk=19, Hkv=4),  # KV-cache block: fewer queries than keys
        dict(Tq=19, Tk=5, Hkv=4),  # more queries than keys: rows with no visible key
        dict(Tq=17, Tk=17, Hkv=2),  # grouped-query attention
        dict(Tq=17, Tk=17, Hkv=1),  # multi-query attention
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_backend_matches_float64_reference(backend, shape, causal):
    torch.manual_seed(0)
    q, k, v = _qkv(**shape)
    expected = _forward_backward("naive", q.double(), k.double(), v.double(), causal)
    got = _forward_backward(backend, q, k, v, causal)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        assert torch.isfinite(g).all(), f"{backend} {name} has non-finite values"
        torch.testing.assert_close(g, e.float(), atol=2e-5, rtol=2e-5, msg=f"{backend} {name}")


@pytest.mark.parametrize("backend", REFERENCE_BACKENDS)
def test_rows_without_visible_keys_are_zero(backend):
    torch.manual_seed(1)
    q, k, v = _qkv(Tq=6, Tk=2)
    out = attention(q, k, v, causal=True, backend=backend)
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))  # queries 0..3 see no key
    assert out[:, :, 4:].abs().sum() > 0


def test_custom_scale_matches_prescaled_queries():
    torch.manual_seed(2)
    q, k, v = _qkv()
    with torch.no_grad():
        scaled = attention(q, k, v, scale=0.3, backend="naive")
        prescaled = attention(q * (0.3 * q.shape[-1] ** 0.5), k, v, backend="naive")
    torch.testing.assert_close(scaled, prescaled, atol=1e-5, rtol=1e-5)


def test_strided_views_give_the_same_result():
    torch.manual_seed(3)
    B, T, nh, hs = 2, 9, 3, 8
    qkv = torch.randn(B, T, 3 * nh * hs)
    q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in qkv.split(nh * hs, dim=2))
    assert not q.is_contiguous()
    for backend in REFERENCE_BACKENDS:
        torch.testing.assert_close(
            attention(q, k, v, backend=backend),
            attention(q.contiguous(), k.contiguous(), v.contiguous(), backend="naive"),
            atol=1e-5, rtol=1e-5,
        )


def test_registry_lists_and_extends_backends():
    assert {"naive", "compile", "sdpa", "triton"} <= set(available_backends())
    with pytest.raises(ValueError, match="unknown attention backend 'flash3'.*naive.*sdpa"):
        attention(*_qkv(), backend="flash3")
    register_backend("test_double_naive", lambda q, k, v, causal, scale: 2 * attention(q, k, v, causal, scale, "naive"))
    q, k, v = _qkv()
    torch.testing.assert_close(attention(q, k, v, backend="test_double_naive"), 2 * attention(q, k, v, backend="naive"))
    with pytest.raises(ValueError, match="already registered"):
        register_backend("naive", lambda *a: None)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: (torch.randn(2, 8, 16), torch.randn(2, 8, 16), torch.randn(2, 8, 16)), ValueError, "must be 4-D"),
        (lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8).half(), torch.randn(1, 2, 4, 8)), TypeError, "share one dtype"),
        (lambda: (torch.randn(1, 2, 4, 8).int(),) * 3, TypeError, "float16, bfloat16"),
        (lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8)), ValueError, "same shape"),
        (lambda: (torch.randn(1, 2, 4, 8), torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)), ValueError, "batch size"),
        (lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)), ValueError, "head_dim"),
        (lambda: (torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)), ValueError, "multiple"),
        (lambda: ([[1.0]], torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)), TypeError, "torch.Tensor"),
    ],
)
def test_bad_input_names_the_problem(make, error, match):
    with pytest.raises(error, match=match):
        attention(*make(), backend="naive")


def test_bad_scale_is_rejected():
    with pytest.raises(ValueError, match="scale must be a positive number"):
        attention(*_qkv(), scale=-1.0, backend="naive")


def test_module_form_matches_the_call_and_checks_the_backend_early():
    torch.manual_seed(4)
    q, k, v = _qkv(Hkv=2)
    module = Attention(backend="naive", causal=False, scale=0.2)
    assert list(module.parameters()) == [] and "backend='naive'" in repr(module)
    torch.testing.assert_close(module(q, k, v), attention(q, k, v, causal=False, scale=0.2, backend="naive"))
    with pytest.raises(ValueError, match="unknown attention backend 'flash3'"):
        Attention(backend="flash3")


@pytest.mark.parametrize("backend", REFERENCE_BACKENDS)
def test_single_decoding_query_sees_every_key(backend):
    # KV-cache decoding: one new query against Tk cached keys is the last position (bottom-right)
    torch.manual_seed(5)
    q, k, v = _qkv(Tq=1, Tk=13, Hkv=2)
    expected = _forward_backward("naive", q.double(), k.double(), v.double(), causal=False)
    got = _forward_backward(backend, q, k, v, causal=True)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(g, e.float(), atol=2e-5, rtol=2e-5, msg=f"{backend} {name}")
