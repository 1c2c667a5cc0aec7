"""FlashAttention's terms (issue 47, docs/flash_attention.md §15): softcap, ALiBi slopes, attention sinks, the returned
log-sum-exp and a value head dim of its own. The naive reference against a direct float64 formula, the one-line
errors, the backends that refuse a term, and the triton kernels in the CPU interpreter; on the GPU: test_terms_gpu.py."""
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import (TERM_CASES, assert_compiled_like_eager, assert_terms_match_fp64, packed_document_ids, qkv,
                     slopes_for, terms_for, whole_paths)

from attention import attention, attention_qkvpacked, attention_varlen
from attention.masks import causal_mask


def direct(q, k, v, causal, scale, softcap=0.0, alibi_slopes=None, sinks=None):
    """The terms written out in float64, row by row as §15 defines them: -> (out, lse)."""
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, Tq, _ = q.shape
    Tk, group = k.shape[2], Hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        i = torch.arange(Tq)[:, None] + Tk - Tq
        j = torch.arange(Tk)[None, :]
        s = s - alibi_slopes.double().view(-1, Hq, 1, 1) * (i - j).abs()
    if causal:
        s = s.masked_fill(~causal_mask(Tq, Tk), float("-inf"))
    sink = (torch.full((Hq,), float("-inf"), dtype=torch.float64) if sinks is None else sinks.double())
    sink = sink.view(1, Hq, 1).expand(B, Hq, Tq)
    m = torch.maximum(s.amax(-1), sink)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    weights = torch.exp(s - m[..., None])
    total = weights.sum(-1) + torch.exp(sink - m)
    out = torch.einsum("bhij,bhjd->bhid", weights / total.clamp_min(1e-300)[..., None], v)
    lse = torch.where(total > 0, m + torch.log(total), torch.full_like(m, float("inf")))
    return out, lse


@pytest.mark.parametrize("case", TERM_CASES)
@pytest.mark.parametrize("causal, Tq, Tk, Dv", [(True, 37, 53, 24), (False, 37, 53, 16), (True, 53, 37, 40)])
def test_reference_matches_direct_formula(case, causal, Tq, Tk, Dv):
    # Tq > Tk with causal: rows that see no key (output 0; lse +inf, or the sink's own logit)
    torch.manual_seed(0)
    q, k, _ = qkv(B=2, Hq=4, Hkv=2, Tq=Tq, Tk=Tk, D=24, dtype=torch.float64)
    v = torch.randn(2, 2, Tk, Dv, dtype=torch.float64)
    terms = TERM_CASES[case]()
    out, lse = attention(q, k, v, causal, 0.3, backend="naive", return_lse=True, **terms)
    want_out, want_lse = direct(q, k, v, causal, 0.3, **terms)
    assert out.shape == (2, 4, Tq, Dv) and lse.shape == (2, 4, Tq) and lse.dtype == torch.float64
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    assert torch.equal(attention(q, k, v, causal, 0.3, backend="naive", **terms), out)


def test_reference_sink_gradient_is_the_derived_one():
    # §15: d sink_h = -sum over the rows of head h of P_sink * Delta, P_sink = exp(sink - lse), Delta = rowsum(dO * O)
    torch.manual_seed(1)
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Tq=37, Tk=29, D=16, dtype=torch.float64)
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out, lse = attention(q, k, v, True, 0.25, backend="naive", sinks=sinks, return_lse=True)
    do = torch.randn_like(out)
    grad, = torch.autograd.grad(out, sinks, do)
    delta = (do * out).sum(-1)
    torch.testing.assert_close(grad, -(torch.exp(sinks[:, None] - lse) * delta).sum((0, 2)), rtol=0, atol=1e-12)


def test_reference_softcap_gradient_is_the_derived_one():
    # §15: with c = softcap, s' = c tanh(s / c) and ds = ds' (1 - tanh^2(s / c)); dQ = scale dS K
    torch.manual_seed(2)
    q, k, v = qkv(Tq=9, Tk=11, D=16, dtype=torch.float64)
    q.requires_grad_()
    out = attention(q, k, v, False, 0.5, backend="naive", softcap=1.5)
    do = torch.randn_like(out)
    grad, = torch.autograd.grad(out, q, do)
    t = torch.tanh(q.detach() @ k.transpose(-2, -1) * 0.5 / 1.5)
    p = torch.softmax(1.5 * t, -1)
    dp = do @ v.transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * (1 - t ** 2)
    torch.testing.assert_close(grad, 0.5 * ds @ k, rtol=0, atol=1e-12)


def test_varlen_reference_takes_the_terms():
    # the per-sequence reference: slopes (n, H) one row per sequence, lse (H, total_q), a sequence with no keys
    torch.manual_seed(3)
    lengths_q, lengths_k = [5, 17, 3], [9, 17, 0]
    q = torch.randn(sum(lengths_q), 4, 16, dtype=torch.float64)
    k = torch.randn(sum(lengths_k), 2, 16, dtype=torch.float64)
    v = torch.randn(sum(lengths_k), 2, 24, dtype=torch.float64)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    slopes, sinks = slopes_for(3, 4, per_batch=True), torch.randn(4)
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, 17, 17, causal=True, softcap=4.0, alibi_slopes=slopes,
                                backend="naive", sinks=sinks, return_lse=True)
    assert out.shape == (25, 4, 24) and lse.shape == (4, 25)
    for i, (q0, q1, k0, k1) in enumerate([(0, 5, 0, 9), (5, 22, 9, 26)]):
        want_out, want_lse = direct(q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None],
                                    v[k0:k1].transpose(0, 1)[None], True, 16 ** -0.5, 4.0, slopes[i], sinks)
        torch.testing.assert_close(out[q0:q1], want_out[0].transpose(0, 1), rtol=0, atol=1e-12)
        torch.testing.assert_close(lse[:, q0:q1], want_lse[0], rtol=0, atol=1e-12)
    assert not out[22:].any() and torch.equal(lse[:, 22:], sinks.double()[:, None].expand(4, 3))


@pytest.mark.parametrize("case", ["softcap", "alibi per batch"])
def test_flex_takes_softcap_and_alibi(case):
    # FlexAttention through a score_mod; on the CPU it runs eagerly (forward only), float64
    torch.manual_seed(4)
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Tq=37, Tk=53, D=16, dtype=torch.float64)
    terms = TERM_CASES[case]()
    torch.testing.assert_close(attention(q, k, v, True, backend="flex", **terms),
                               direct(q, k, v, True, 0.25, **terms)[0], rtol=0, atol=1e-12)


def test_sdpa_takes_a_value_head_dim():
    torch.manual_seed(5)
    q, k, _ = qkv(Tq=20, Tk=30, D=24, dtype=torch.float64)
    v = torch.randn(1, 2, 30, 16, dtype=torch.float64)
    torch.testing.assert_close(attention(q, k, v, True, backend="sdpa"), direct(q, k, v, True, 24 ** -0.5)[0])


def _call(backend="naive", **changes):
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Tq=5, Tk=5, D=16)
    return lambda: attention(**{"q": q, "k": k, "v": v, "backend": backend, **changes})


@pytest.mark.parametrize("call, error, message", [
    (_call(softcap=-1.0), ValueError, "softcap must be a number >= 0 (0 = off"),
    (_call(softcap=True), ValueError, "softcap must be a number >= 0"),
    (_call(softcap=float("inf")), ValueError, "softcap must be a number >= 0"),
    (_call(alibi_slopes=torch.ones(2)), ValueError, "alibi_slopes must have shape (4,) or (2, 4) (batch, heads), one "
                                                    "value per query head, got (2,)"),
    (_call(alibi_slopes=torch.ones(3, 4)), ValueError, "alibi_slopes must have shape (4,) or (2, 4)"),
    (_call(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError, "alibi_slopes must be float32"),
    (_call(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a torch.Tensor or None, got list"),
    (_call(sinks=torch.ones(2, 4)), ValueError, "sinks must have shape (4,), one value per query head, got (2, 4)"),
    (_call(sinks=torch.ones(4, device="meta")), ValueError,
     "sinks is on meta but q is on cpu; move it with .to(q.device)"),
    (_call(alibi_slopes=torch.ones(4, device="meta")), ValueError, "alibi_slopes is on meta but q is on cpu"),
    (_call(sinks=torch.ones(4, dtype=torch.int64)), TypeError, "sinks must be a floating tensor"),
    (_call(backend="sdpa", softcap=1.0), ValueError, "backend 'sdpa' does not compute softcap; use one of: compile, "
                                                     "flex, naive"),
    (_call(backend="sdpa", sinks=torch.ones(4), return_lse=True), ValueError,
     "backend 'sdpa' does not compute sinks, return_lse; use one of: compile, naive"),
    (_call(backend="moba", v=torch.ones(2, 2, 5, 8)), ValueError, "backend 'moba' does not compute value_head_dim"),
    (_call(v=torch.ones(2, 2, 6, 8)), ValueError, "k and v must have the same shape but for the head dim"),
])
def test_bad_terms_fail_in_one_line(call, error, message):
    with pytest.raises(error, match=re.escape(message)) as caught:
        call()
    assert "\n" not in str(caught.value)


def test_value_head_dim_is_refused_where_one_head_dim_is_taken():
    from attention import decode_attention

    q, k, _ = qkv(B=1, Hq=2, Hkv=2, Tq=1, Tk=8, D=16)
    with pytest.raises(ValueError, match="v has head_dim 8 but q and k have 16"):
        decode_attention(q, k, torch.zeros(1, 2, 8, 8), torch.tensor([8]), backend="naive")


# ---------------------------------------------------------------------------------------------------------------------
# the triton kernels (CPU interpreter: fp16 and fp32, small odd sizes), against float64


# name -> qkv() sizes, v's head dim, causal, mask keywords(B, Tk): odd lengths, heads grouped, Dv apart from D
LAYOUTS = {
    "causal": (dict(B=2, Hq=4, Hkv=2, Tq=37, Tk=53, D=24, dtype=torch.float16), 16, True, lambda B, Tk: {}),
    "full": (dict(B=1, Hq=2, Hkv=2, Tq=37, Tk=29, D=64, dtype=torch.float32), 64, False, lambda B, Tk: {}),
    "rows without keys": (dict(B=1, Hq=3, Hkv=1, Tq=45, Tk=20, D=16, dtype=torch.float32), 24, True,
                          lambda B, Tk: {}),  # Tq > Tk: 25 rows see no key (lse the sink's, or +inf)
    "window": (dict(B=2, Hq=2, Hkv=1, Tq=53, Tk=53, D=24, dtype=torch.float16), 24, True,
               lambda B, Tk: {"window": (9, 0)}),
    "documents": (dict(B=2, Hq=4, Hkv=2, Tq=45, Tk=45, D=32, dtype=torch.float16), 16, True,
                  lambda B, Tk: {"document_ids": packed_document_ids(B, Tk, [[10, 1, 40], [20, 30]])}),
}


# each term alone on the causal GQA layout, all of them together on every layout, and the sink where rows see no key
TERM_LAYOUTS = ([(case, "causal") for case in TERM_CASES] + [("all", layout) for layout in LAYOUTS if layout != "causal"]
                + [("sinks", "rows without keys")])


@pytest.mark.parametrize("case, layout", TERM_LAYOUTS)
def test_triton_terms_match_fp64(case, layout):
    sizes, Dv, causal, masks = LAYOUTS[layout]
    torch.manual_seed(11)
    q, k, _ = qkv(**sizes)
    v = torch.randn(*k.shape[:-1], Dv, dtype=k.dtype)
    assert_terms_match_fp64(q, k, v, causal, **masks(sizes["B"], sizes["Tk"]),
                            **terms_for(case, sizes["B"], sizes["Hq"]))


def test_triton_terms_with_a_custom_scale_and_softcap_that_bites():
    # scores of several times softcap: tanh saturates, its derivative vanishes there
    torch.manual_seed(12)
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Tq=33, Tk=33, D=16)
    assert_terms_match_fp64(q * 3, k * 3, v, True, 0.9, softcap=1.0, sinks=torch.tensor([0.5, -3.0]))


def test_triton_value_head_dims_of_mla():
    # DeepSeek's MLA: q and k of 192, v of 128; the tiles take the wider (256-wide) head
    torch.manual_seed(13)
    q, k, _ = qkv(B=1, Hq=2, Hkv=2, Tq=20, Tk=24, D=192, dtype=torch.float16)
    assert_terms_match_fp64(q, k, torch.randn(1, 2, 24, 128, dtype=torch.float16), True)


@pytest.mark.parametrize("case", ["all", "sinks"])
def test_triton_varlen_terms_match_fp64(case):
    # sequences of 0 and 1 rows, ragged ones, one without keys (its rows: output 0, lse the sink's); slopes per sequence
    torch.manual_seed(14)
    lengths_q, lengths_k = [5, 40, 1, 0, 33, 3], [5, 40, 1, 4, 30, 0]
    q = torch.randn(sum(lengths_q), 4, 24, dtype=torch.float16)
    k = torch.randn(sum(lengths_k), 2, 24, dtype=torch.float16)
    v = torch.randn(sum(lengths_k), 2, 16, dtype=torch.float16)
    cu_q, cu_k = (F.pad(torch.tensor(n).cumsum(0), (1, 0)).to(torch.int32) for n in (lengths_q, lengths_k))
    assert_terms_match_fp64(q, k, v, True, varlen=(cu_q, cu_k, 40, 40), **terms_for(case, 6, 4))


def test_triton_varlen_window_and_softcap_match_fp64():
    torch.manual_seed(15)
    lengths = [7, 50, 2]
    q, k, v = (torch.randn(sum(lengths), 2, 16) for _ in range(3))
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    assert_terms_match_fp64(q, k, v, False, varlen=(cu, cu, 50, 50), window_size=(6, 4), softcap=1.5,
                            alibi_slopes=slopes_for(3, 2, per_batch=True))


def test_triton_qkvpacked_takes_the_terms():
    torch.manual_seed(16)
    packed = torch.randn(2, 37, 3, 4, 16, dtype=torch.float16)
    sinks = torch.randn(4, requires_grad=True)
    terms = dict(softcap=2.0, alibi_slopes=slopes_for(2, 4), sinks=sinks)
    results = []
    for backend in ("triton", "naive"):
        leaf = packed.detach().requires_grad_()
        y = attention_qkvpacked(leaf, backend=backend, **terms)
        results.append((y, *torch.autograd.grad(y, (leaf, sinks), torch.ones_like(y))))
    for ours, naive, tol in zip(*results, (2e-3, 2e-2, 2e-2)):
        torch.testing.assert_close(ours, naive, atol=tol, rtol=0)


def test_tensor_descriptor_loads_take_the_terms(monkeypatch):
    # §9 TMA (NANOFLASH_TMA=1): V and O as descriptors of V's own head dim
    from attention.flash import dispatch

    monkeypatch.setattr(dispatch, "TMA_MODE", "1")
    torch.manual_seed(26)
    q, k, _ = qkv(B=2, Hq=4, Hkv=2, Tq=45, Tk=45, D=64, dtype=torch.float16)
    v = torch.randn(2, 2, 45, 32, dtype=torch.float16)
    assert dispatch.use_tma(q, k, v)
    assert_terms_match_fp64(q, k, v, True, **terms_for("all", 2, 4))


def test_launch_plans_take_each_calls_terms(monkeypatch):
    # a second call of one layout runs the first call's plan with its own softcap value, slopes and sinks
    taken = whole_paths(monkeypatch)
    for i, softcap in enumerate((2.0, 5.0, 5.0)):
        torch.manual_seed(17 + i)
        q, k, _ = qkv(B=2, Hq=4, Hkv=2, Tq=37, Tk=45, D=24, dtype=torch.float16)
        v = torch.randn(2, 2, 45, 16, dtype=torch.float16)
        assert_terms_match_fp64(q, k, v, True, softcap=softcap, alibi_slopes=torch.rand(2, 4),
                                sinks=torch.randn(4))
    assert taken == ["_forward_plan", "_backward_plan"]
    assert_terms_match_fp64(q, k, v, True)  # the same tensors without the terms: another plan
    assert taken == ["_forward_plan", "_backward_plan"] * 2


def test_terms_compile_in_only_where_used():
    # a call without the terms has the constexprs (so the tuning keys and shipped choices) it had before them
    from attention.flash import terms as flash_terms

    q, k, v = qkv(D=24)
    for kernel in ("fwd", "dq", "dkdv"):
        assert flash_terms.term_constants(flash_terms.NO_TERMS, q, v, kernel) == {}
    assert flash_terms.term_args(flash_terms.NO_TERMS, True) == (None,) * 8  # dropout's two (§16) at the end
    terms = flash_terms.Terms(1.0, torch.ones(2), torch.ones(2))
    assert flash_terms.term_constants(terms, q, v[..., :16], "fwd") == dict(SOFTCAP=1, ALIBI=True, SINKS=True,
                                                                            HEAD_DV=16, BLOCK_DV=16)
    assert "SINKS" not in flash_terms.term_constants(terms, q, v, "dkdv")  # it reads the sink's share in lse


class HopperRan(Exception):
    pass


def test_terms_reach_the_hopper_kernels_on_sm90(monkeypatch):
    # dispatch sends softcap, ALiBi and sinks to the Hopper kernels on an sm_90 GPU (its capability mocked here, the
    # kernels faked: Gluon has no CPU interpreter), with the terms' arguments, and dropout; a value head dim of its
    # own and varlen calls with a term stay on the `tl` kernels
    from attention.flash import dispatch
    from attention.flash.hopper import backward as hopper_backward
    from attention.flash.hopper import forward as hopper_forward
    from attention.flash.launch import Launched

    taken = []

    def fake_forward(q, k, v, o, lse, causal, scale, tile, documents=None, row_src=None, term_args=(None,) * 8):
        taken.append(("fwd", term_args))
        o.zero_(), lse.zero_()
        return Launched(None, lambda *call: None)

    def fake_backward(do, q, k, v, o, lse, dq, dk, dv, causal, scale, tile, documents=None, gathered=None,
                      term_args=(None,) * 8, sink_rows=None, sinks=None):
        taken.append(("bwd", term_args + (sink_rows, sinks)))
        raise HopperRan

    monkeypatch.setattr(hopper_forward, "INTERPRET", False)  # as compiled on an sm_90 GPU
    monkeypatch.setattr(hopper_forward, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper_forward, "forward", fake_forward)
    monkeypatch.setattr(hopper_backward, "backward", fake_backward)
    monkeypatch.setattr(dispatch, "HOPPER_MODE", "1")
    torch.manual_seed(18)
    q, k, v = (t.requires_grad_() for t in qkv(B=2, Hq=4, Hkv=2, Tq=40, Tk=40, D=64, dtype=torch.float16))
    slopes, sinks = slopes_for(2, 4, per_batch=True), torch.randn(4, requires_grad=True)
    for terms in (dict(softcap=2.5), dict(alibi_slopes=slopes), dict(sinks=sinks),
                  dict(alibi_slopes=slopes, sinks=sinks), dict(softcap=3.0, alibi_slopes=slopes[0], sinks=sinks)):
        taken.clear()
        out = attention(q, k, v, True, backend="triton", **terms)
        do = torch.randn_like(out)  # (a sum's gradient, stride 0, is not one the copy engine reads)
        if "sinks" in terms and "softcap" in terms:  # the sinks' gradient with softcap: the `tl` backward
            out.backward(do)
            assert [kind for kind, _ in taken] == ["fwd"]
        else:
            with pytest.raises(HopperRan):
                out.backward(do)
            assert [kind for kind, _ in taken] == ["fwd", "bwd"]
            sink_rows, given_sinks = taken[1][1][8:]  # the rows the backward adds into, shaped as lse, and the sinks
            assert (given_sinks is sinks and sink_rows.shape == (2, 4, 40)) if "sinks" in terms else (
                sink_rows is None and given_sinks is None)
        if "sinks" in terms:  # the forward folds them in
            assert torch.equal(taken[0][1][4], sinks) and taken[0][1][5] == 1
        else:
            assert taken[0][1][4:6] == (None, None)
        for _, args in taken:
            assert args[0] == (terms.get("softcap") or None)
            slope_args = args[1:4]
            if "alibi_slopes" in terms:  # the slopes, (B, H) or (H,) (batch stride 0)
                given = terms["alibi_slopes"]
                assert torch.equal(slope_args[0], given) and slope_args[1:] == (
                    (0, 1) if given.dim() == 1 else given.stride())
            else:
                assert slope_args == (None,) * 3
    # dropout: both Hopper kernels, with its p and the call's seed (§16)
    taken.clear()
    with pytest.raises(HopperRan):
        attention(q, k, v, True, backend="triton", dropout_p=0.1).backward(do)
    assert [kind for kind, _ in taken] == ["fwd", "bwd"]
    assert all(args[6] == 0.1 and torch.equal(args[7], taken[0][1][7]) for _, args in taken)
    # not on the Hopper kernels: a value head dim of its own, a varlen call with a term
    taken.clear()
    attention(q, k, torch.randn(2, 2, 40, 32, dtype=torch.float16), True, backend="triton", softcap=2.0)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 25, 25, causal=True,
                     softcap=2.0)
    assert taken == []
    attention(q, k, v, True, backend="triton")  # a plain call still goes there
    assert [kind for kind, *_ in taken] == ["fwd"]


def test_ops_with_terms_pass_opcheck():
    from attention.flash import dispatch
    from attention.flash import terms as flash_terms
    from attention.flash.autograd import _op_args, flash_attn_bwd, flash_attn_fwd

    torch.manual_seed(19)
    q, k, _ = qkv(Hq=4, Hkv=2, Tq=20, Tk=24, D=16)
    v = torch.randn(1, 2, 24, 32)
    rest = _op_args(dispatch.DENSE, None, flash_terms.Terms(2.0, slopes_for(1, 4), torch.randn(4)))
    torch.library.opcheck(flash_attn_fwd, (q, k, v, True, 0.25, *rest))
    out, lse = flash_attn_fwd(q, k, v, True, 0.25, *rest)
    assert out.shape == (1, 4, 20, 32)
    torch.library.opcheck(flash_attn_bwd, (torch.randn_like(out), q, k, v, out, lse, True, 0.25, *rest))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_torch_compile_fullgraph_with_terms(varlen):
    # Inductor compiles the ops around ours for the CPU; the sinks' gradient is traced torch operations
    torch.manual_seed(20)
    q, k, _ = qkv(B=1, Hq=4, Hkv=2, Tq=20, Tk=20, D=16)
    v = torch.randn(1, 2, 20, 24)
    sinks, slopes = torch.randn(4), slopes_for(1, 4)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)

    def fn(q, k, v, sinks):
        if varlen:
            q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
            return attention_varlen(q, k, v, cu, cu, 13, 13, causal=True, softcap=2.0, alibi_slopes=slopes,
                                    sinks=sinks)
        return attention(q, k, v, backend="triton", softcap=2.0, alibi_slopes=slopes, sinks=sinks)

    assert_compiled_like_eager(fn, (q, k, v, sinks), tol=1e-5)
