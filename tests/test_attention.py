"""attention(): the reference backends agree with each other and with a float64 reference; the registry (what each
backend takes: masks, options, a KV cache), its options and bounds; bad input fails clearly, before any backend
runs."""
import dataclasses
import re

import pytest
import torch
from helpers import packed_document_ids, packed_qkv, projection_views, qkv, registered_backend

from attention import Attention, Backend, BlockMask, attention, attention_qkvpacked, available_backends, backend_options, causal_mask, get_backend, keys_per_query, register_backend
from attention import registry

REFERENCE_BACKENDS = ["naive", "compile", "sdpa"]
ALL_BACKENDS = ["naive", "compile", "sdpa", "triton", "flex", "moba", "cuda"]


def _qkv(**shape):
    """The reference tests' inputs: batch 2, 4 query heads of 16 channels, leaves that take gradients."""
    return qkv(**{"B": 2, "Hq": 4, "Hkv": 4, "Tq": 33, "Tk": 33, "D": 16, **shape}, requires_grad=True)


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
    q, k, v = projection_views(2, 9, 3, 8)
    assert not q.is_contiguous()
    for backend in REFERENCE_BACKENDS:
        torch.testing.assert_close(
            attention(q, k, v, backend=backend),
            attention(q.contiguous(), k.contiguous(), v.contiguous(), backend="naive"),
            atol=1e-5, rtol=1e-5,
        )


def test_registry_lists_and_extends_backends(monkeypatch):
    assert available_backends() == sorted(ALL_BACKENDS)
    with pytest.raises(ValueError, match="unknown attention backend 'flash3'; choose one of: compile, cuda, flex, "
                                         "moba, naive, sdpa, triton"):
        attention(*_qkv(), backend="flash3")
    spec = registered_backend(monkeypatch, "test_double_naive",
                              lambda q, k, v, causal, scale: 2 * attention(q, k, v, causal, scale, "naive"))
    assert isinstance(spec, Backend) and not spec.supports_masks and spec.exact and spec.options == {}
    q, k, v = _qkv()
    torch.testing.assert_close(attention(q, k, v, backend="test_double_naive"), 2 * attention(q, k, v, backend="naive"))
    with pytest.raises(ValueError, match="already registered"):
        register_backend("naive", lambda *a: None)
    with pytest.raises(ValueError, match="backend 'test_double_naive' does not support window"):  # no masks
        attention(q, k, v, backend="test_double_naive", window=(4, 0))


def test_a_backend_registered_for_one_test_is_gone_after_it(monkeypatch):
    with monkeypatch.context() as patch:
        registered_backend(patch, "test_for_now", lambda q, k, v, causal, scale: q)
        assert "test_for_now" in available_backends()
    assert "test_for_now" not in available_backends()
    with pytest.raises(ValueError, match="unknown attention backend 'test_for_now'"):
        get_backend("test_for_now")


def _three(B=1, Hq=2, Hkv=2, Tq=4, Tk=4, D=8):
    return qkv(B, Hq, Hkv, Tq, Tk, D)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: tuple(t.flatten(0, 1) for t in _three()), ValueError, "must be 4-D"),
        (lambda: (_three()[0], _three()[1].half(), _three()[2]), TypeError, "share one dtype"),
        (lambda: tuple(t.int() for t in _three()), TypeError, "float16, bfloat16"),
        (lambda: (*_three()[:2], _three(Tk=5)[2]), ValueError, "same shape"),
        (lambda: (_three()[0], *_three(B=2)[1:]), ValueError, "batch size"),
        (lambda: (_three()[0], *_three(D=16)[1:]), ValueError, "head_dim"),
        (lambda: _three(Hq=3), ValueError, "multiple"),
        (lambda: ([[1.0]], *_three()[1:]), TypeError, "torch.Tensor"),
    ],
)
def test_bad_input_names_the_problem(make, error, match):
    with pytest.raises(error, match=match):
        attention(*make(), backend="naive")


@pytest.mark.parametrize("scale", [-1.0, 0.0, 0, float("inf"), float("nan"), True, "0.5"])
def test_bad_scale_is_rejected(scale):
    with pytest.raises(ValueError, match=re.escape(f"scale must be a positive number or None (meaning "
                                                   f"1/sqrt(head_dim)), got {scale!r}")):
        attention(*_qkv(), scale=scale, backend="naive")


def test_a_positive_int_scale_is_a_scale():
    q, k, v = _qkv()
    torch.testing.assert_close(attention(q, k, v, scale=2, backend="naive"), attention(q, k, v, scale=2.0,
                                                                                        backend="naive"))


DIMS = ("batch", "heads", "seq_len", "head_dim")


def _zero_sized(dim: str, tensor: str = "q"):
    """q, k, v of batch 2, 2 heads, 64 positions, head dim 16, with `dim` 0 in `tensor` (q: in all three where the
    dim is theirs too, so that only the zero can be wrong)."""
    sizes = dict(B=2, Hq=2, Hkv=2, Tq=64, Tk=64, D=16)
    zeroed = {"batch": ["B"], "heads": ["Hq", "Hkv"], "seq_len": ["Tq", "Tk"] if tensor == "q" else ["Tk"],
              "head_dim": ["D"]}[dim]
    return qkv(**{**sizes, **dict.fromkeys(zeroed, 0)})


@pytest.fixture
def backends_that_must_not_run(monkeypatch):
    """Each backend's function replaced by one that records its calls: a refusal must come before it."""
    calls = []
    for name in ALL_BACKENDS:
        monkeypatch.setitem(registry._BACKENDS, name, dataclasses.replace(
            get_backend(name), fn=lambda *args, _name=name, **kwargs: calls.append(_name)))
    return calls


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dim", DIMS)
def test_a_zero_sized_dim_is_refused_by_every_backend(backend, dim):
    q, k, v = _zero_sized(dim)
    message = re.escape(f"q has {dim} 0 (shape {tuple(q.shape)}); attention needs at least one of each")
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, backend=backend)
    packed_sizes = dict(B=2, T=64, nh=2, hs=16) | {{"batch": "B", "heads": "nh", "seq_len": "T",
                                                    "head_dim": "hs"}[dim]: 0}
    with pytest.raises(ValueError, match=f"q has {dim} 0"):
        attention_qkvpacked(packed_qkv(**packed_sizes), backend=backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dim", DIMS)
def test_a_zero_sized_dim_is_refused_before_the_backend_runs(backend, dim, backends_that_must_not_run):
    with pytest.raises(ValueError, match=f"q has {dim} 0"):
        attention(*_zero_sized(dim), backend=backend)
    with pytest.raises(ValueError, match="k has seq_len 0"):  # queries but no keys: k is named
        attention(*_zero_sized("seq_len", tensor="k"), backend=backend)
    assert backends_that_must_not_run == []
    attention(*qkv(D=16), backend=backend)  # the same call on sizes of at least 1 reaches the backend
    assert backends_that_must_not_run == [backend]


def test_each_backend_says_what_it_takes():
    for name in ("naive", "compile", "sdpa", "triton"):  # softmax attention itself, masks, KV caches, no options
        spec = get_backend(name)
        assert (spec.exact, spec.supports_masks, spec.kv_cache, dict(spec.options)) == (True, True, True, {}), name
        assert spec.packed == (name == "triton")  # only the triton kernels write qkv's gradient as one tensor
    moba = get_backend("moba")
    assert isinstance(moba, Backend)
    assert (moba.exact, moba.kv_cache, moba.supports_masks, moba.packed) == (False, False, False, False)
    assert dict(moba.options) == {"moba_block": 512, "moba_topk": 3}
    assert moba.keys_per_query(moba_block=128, moba_topk=1) == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        moba.exact = True


def test_backend_options_fill_the_defaults_and_check_names_and_values():
    assert backend_options("moba") == {"moba_block": 512, "moba_topk": 3}
    assert backend_options("moba", moba_topk=0) == {"moba_block": 512, "moba_topk": 0}
    assert backend_options("moba", moba_block=128, moba_topk=1) == {"moba_block": 128, "moba_topk": 1}
    assert backend_options("sdpa") == {} and backend_options("triton") == {}
    with pytest.raises(ValueError, match=re.escape("attention backend 'moba' got unknown option(s) ['block_size', "
                                                   "'topk']; its options are moba_block, moba_topk")):
        backend_options("moba", block_size=128, topk=1)
    with pytest.raises(ValueError, match=re.escape("attention backend 'sdpa' got unknown option(s) ['moba_block']; "
                                                   "it takes no options")):
        backend_options("sdpa", moba_block=128)
    with pytest.raises(ValueError, match="unknown attention backend 'flash3'"):
        backend_options("flash3")


@pytest.mark.parametrize("options, match", [
    (dict(moba_block=8), r"moba_block must be an int >= 16 \(keys per MoBA block.*got 8"),
    (dict(moba_block=128.0), "moba_block must be an int >= 16"),
    (dict(moba_block=True), "moba_block must be an int >= 16"),
    (dict(moba_topk=-1), r"moba_topk must be an int >= 0 \(earlier blocks each query reads.*got -1"),
    (dict(moba_topk=True), "moba_topk must be an int >= 0"),
])
def test_bad_option_values_name_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        backend_options("moba", **options)
    with pytest.raises(ValueError, match=match):  # attention() checks them before any work
        attention(*qkv(Tq=64, Tk=64, D=16), backend="moba", **options)


def test_an_option_of_another_backend_is_refused():
    with pytest.raises(ValueError, match=re.escape("attention backend 'sdpa' got unknown option(s) ['moba_block']")):
        attention(*qkv(), backend="sdpa", moba_block=128)
    with pytest.raises(ValueError, match="unknown option"):
        attention_qkvpacked(packed_qkv(), backend="triton", moba_topk=1)


def test_keys_per_query_is_the_most_keys_one_causal_query_reads():
    assert keys_per_query("sdpa", 1024) == 1024
    assert keys_per_query("triton", 1024, window=256) == 257  # itself and the 256 before it
    assert keys_per_query("naive", 1024, window=4096) == 1024
    assert keys_per_query("moba", 1024) == 1024  # its own and 3 earlier blocks of 512: every key
    assert keys_per_query("moba", 8192) == 2048
    assert keys_per_query("moba", 8192, moba_block=128, moba_topk=1) == 256
    assert keys_per_query("moba", 100, moba_block=128, moba_topk=1) == 100
    with pytest.raises(ValueError, match="moba_topk must be an int >= 0"):
        keys_per_query("moba", 1024, moba_topk=-1)
    with pytest.raises(ValueError, match="unknown option"):
        keys_per_query("moba", 1024, block_size=128)


@pytest.mark.parametrize("sparse", ["window", "document_ids", "block_mask"])
def test_moba_takes_no_masks(sparse, backends_that_must_not_run):
    q, k, v = qkv(Tq=64, Tk=64, D=16)
    rules = {"window": (8, 0), "document_ids": packed_document_ids(1, 64, [[30, 34]]),
             "block_mask": BlockMask.from_layout(torch.ones(2, 2, dtype=torch.bool), 64, 64)}
    with pytest.raises(ValueError, match="backend 'moba' does not support window / document_ids / block_mask; use "
                                         "one of: compile, flex, naive, sdpa, triton"):
        attention(q, k, v, backend="moba", moba_block=32, **{sparse: rules[sparse]})
    assert backends_that_must_not_run == []


def test_a_registered_backend_takes_options_of_its_own(monkeypatch):
    def scaled_naive(q, k, v, causal, scale, factor):
        return factor * attention(q, k, v, causal, scale, backend="naive")

    def check_factor(factor):
        if not (isinstance(factor, float) and factor > 0):
            raise ValueError(f"factor must be a float > 0, got {factor!r}")

    spec = registered_backend(monkeypatch, "test_scaled", scaled_naive, options={"factor": 2.0},
                              check_options=check_factor, keys_per_query=lambda factor: 8)
    assert spec.options == {"factor": 2.0} and spec.exact
    q, k, v = qkv(D=16)
    naive = attention(q, k, v, backend="naive")
    torch.testing.assert_close(attention(q, k, v, backend="test_scaled"), 2 * naive)  # the default
    torch.testing.assert_close(attention(q, k, v, backend="test_scaled", factor=3.0), 3 * naive)
    assert backend_options("test_scaled", factor=0.5) == {"factor": 0.5}
    with pytest.raises(ValueError, match="factor must be a float > 0, got -1.0"):
        attention(q, k, v, backend="test_scaled", factor=-1.0)
    with pytest.raises(ValueError, match=re.escape("got unknown option(s) ['scale_by']; its options are factor")):
        attention(q, k, v, backend="test_scaled", scale_by=2.0)
    assert keys_per_query("test_scaled", 1024) == 8 and keys_per_query("test_scaled", 4) == 4
    module = Attention(backend="test_scaled", factor=0.5)
    assert module.options == {"factor": 0.5} and "factor=0.5" in repr(module)
    torch.testing.assert_close(module(q, k, v), 0.5 * naive)


def test_module_form_matches_the_call_and_checks_the_backend_early():
    torch.manual_seed(4)
    q, k, v = _qkv(Hkv=2)
    module = Attention(backend="naive", causal=False, scale=0.2)
    assert list(module.parameters()) == [] and "backend='naive'" in repr(module)
    torch.testing.assert_close(module(q, k, v), attention(q, k, v, causal=False, scale=0.2, backend="naive"))
    with pytest.raises(ValueError, match="unknown attention backend 'flash3'"):
        Attention(backend="flash3")
    with pytest.raises(ValueError, match=re.escape("'naive' got unknown option(s) ['moba_block']")):
        Attention(backend="naive", moba_block=128)


def test_module_form_holds_the_backends_options():
    module = Attention(backend="moba", moba_block=32, moba_topk=1)
    assert module.options == {"moba_block": 32, "moba_topk": 1}
    assert repr(module) == "Attention(backend='moba', causal=True, scale=None, moba_block=32, moba_topk=1)"
    assert Attention(backend="moba").options == {"moba_block": 512, "moba_topk": 3}  # the defaults filled in
    with pytest.raises(ValueError, match="moba_block must be an int >= 16"):  # at construction, not at the first call
        Attention(backend="moba", moba_block=8)
    torch.manual_seed(6)
    q, k, v = qkv(1, 2, 1, 64, 64, 16)  # 2 blocks of 32 (the interpreter's tile)
    out = module(q, k, v)
    assert torch.equal(out, attention(q, k, v, backend="moba", moba_block=32, moba_topk=1))
    assert not torch.allclose(out, Attention(backend="moba", moba_block=32, moba_topk=0)(q, k, v))  # the option acts


@pytest.mark.parametrize("backend", REFERENCE_BACKENDS)
def test_single_decoding_query_sees_every_key(backend):
    # KV-cache decoding: one new query against Tk cached keys is the last position (bottom-right)
    torch.manual_seed(5)
    q, k, v = _qkv(Tq=1, Tk=13, Hkv=2)
    expected = _forward_backward("naive", q.double(), k.double(), v.double(), causal=False)
    got = _forward_backward(backend, q, k, v, causal=True)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(g, e.float(), atol=2e-5, rtol=2e-5, msg=f"{backend} {name}")
