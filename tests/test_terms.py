"""FlashAttention's terms (issue 47, docs/flash_attention.md §15): softcap, ALiBi slopes, attention sinks, the returned
log-sum-exp and a value head dim of its own. The naive reference against a direct float64 formula, the one-line
errors, and the backends that refuse a term."""
import re

import pytest
import torch
from helpers import qkv

from attention import attention, attention_varlen
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


def slopes_for(B, Hq, per_batch=False):
    """ALiBi's geometric slopes 2^(-8 h / Hq), per batch row slightly apart with per_batch."""
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / Hq) for h in range(Hq)], dtype=torch.float32)
    return slopes * torch.linspace(1, 1.5, B)[:, None] if per_batch else slopes


# name -> attention()'s keywords for (B, Hq) = (2, 4)
TERM_CASES = {
    "softcap": lambda: dict(softcap=2.5),
    "alibi": lambda: dict(alibi_slopes=slopes_for(2, 4)),
    "alibi per batch": lambda: dict(alibi_slopes=slopes_for(2, 4, per_batch=True)),
    "sinks": lambda: dict(sinks=torch.randn(4)),
    "all": lambda: dict(softcap=3.0, alibi_slopes=slopes_for(2, 4, per_batch=True), sinks=torch.randn(4) + 2),
}


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
