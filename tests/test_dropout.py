"""Attention dropout (issue 47, docs/flash_attention.md §16). A dropped call has no float64 twin (float64 math would
draw another mask), so the kernels are checked through the debug path: dropout.recording() gives the seed a call drew
and dropout.keep_mask the mask that seed gives; the reference is the naive backend in float64 with that mask applied,
judged by the naive backend in the call's dtype with the same mask (helpers.py's criterion). Then: seeds reproduce
under torch.manual_seed and differ from call to call, the keep rate is 1 - p, dropout_p=0 is the plain kernels."""
import numpy as np
import pytest
import torch
from helpers import (assert_errors_within, packed_document_ids, qkv, registered_backend, spy_on_hopper_kernels,
                     whole_paths)

from attention import attention, attention_qkvpacked, attention_varlen, get_backend


def _flash():
    from attention.flash import dispatch, dropout

    return dispatch, dropout


def _out_and_grads(call, leaves, do):
    leaves = [t.detach().requires_grad_() for t in leaves]
    out = call(*leaves)
    return (out, *torch.autograd.grad(out, leaves, do.to(out.dtype)))


def assert_dropout_matches_fp64(q, k, v, causal=True, p=0.25, sinks=None, window=None, document_ids=None, **terms):
    """attention(..., backend="triton", dropout_p=p): out, dq, dk, dv (and dsinks) against the naive backend with the
    mask the call used (keep_mask of its recorded seed), in float64 and in q's dtype. -> (ours, keep)."""
    from attention.registry import _sparse_mask

    _, dropout = _flash()
    B, Hq, Tq, _ = q.shape
    Tk = k.shape[2]
    do = torch.randn(B, Hq, Tq, v.shape[-1], dtype=q.dtype, device=q.device)
    leaves = (q, k, v) + (() if sinks is None else (sinks,))

    def extra(rest):
        return {**terms, **({} if sinks is None else {"sinks": rest[0]})}

    with dropout.recording() as seeds:
        ours = _out_and_grads(lambda q, k, v, *rest: attention(q, k, v, causal, backend="triton", dropout_p=p,
                                                               window=window, document_ids=document_ids,
                                                               **extra(rest)), leaves, do)
    (seed,) = seeds
    keep = dropout.keep_mask(seed, B, Hq, Tq, Tk, p)
    mask = None if window is None and document_ids is None else _sparse_mask(q, k, causal, window, document_ids,
                                                                              None)
    naive = get_backend("naive").fn

    def reference(q, k, v, *rest):
        return naive(q, k, v, causal=causal if mask is None else mask.causal, scale=q.shape[-1] ** -0.5, mask=mask,
                     dropout_p=p, keep=keep, **extra(rest))

    exact = _out_and_grads(reference, [t.double() for t in leaves], do.double())
    math = _out_and_grads(reference, leaves, do)
    names = ("out", "dq", "dk", "dv", "dsinks")[:len(ours)]
    for name, t, like in zip(names, ours, leaves[:1] + leaves):
        assert t.dtype == like.dtype, f"{name} is {t.dtype}"
    assert_errors_within(names, exact, math, ours)
    return ours, keep


# name -> qkv() sizes, causal, mask keywords(B, Tk): odd lengths, grouped heads, fp16 and fp32
LAYOUTS = {
    "causal": (dict(B=2, Hq=4, Hkv=2, Tq=37, Tk=53, D=16, dtype=torch.float16), True, lambda B, Tk: {}),
    "full": (dict(B=1, Hq=2, Hkv=2, Tq=37, Tk=53, D=32, dtype=torch.float32), False, lambda B, Tk: {}),
    "rows without keys": (dict(B=1, Hq=3, Hkv=1, Tq=45, Tk=20, D=16, dtype=torch.float32), True, lambda B, Tk: {}),
    "window": (dict(B=1, Hq=2, Hkv=1, Tq=53, Tk=53, D=16, dtype=torch.float16), True,
               lambda B, Tk: {"window": (9, 0)}),
    "documents": (dict(B=2, Hq=2, Hkv=2, Tq=45, Tk=45, D=32, dtype=torch.float16), True,
                  lambda B, Tk: {"document_ids": packed_document_ids(B, Tk, [[10, 1, 34], [20, 25]])}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_dropout_matches_fp64_with_its_mask(layout):
    sizes, causal, masks = LAYOUTS[layout]
    torch.manual_seed(40)
    q, k, v = qkv(**sizes)
    _, keep = assert_dropout_matches_fp64(q, k, v, causal, p=0.3, **masks(sizes["B"], sizes["Tk"]))
    assert 0 < keep.float().mean() < 1


def test_triton_dropout_with_every_term_matches_fp64():
    # softcap, ALiBi and sinks beside dropout: P (so l and lse) undropped, the sinks' gradient from P * dP dropped
    torch.manual_seed(41)
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Tq=37, Tk=53, D=16, dtype=torch.float16)
    assert_dropout_matches_fp64(q, k, v, True, p=0.2, sinks=torch.randn(4) + 1, softcap=3.0,
                                alibi_slopes=torch.rand(2, 4))


def test_triton_varlen_dropout_matches_fp64_with_its_mask():
    # the varlen kernels count each sequence's rows and keys from its own first: varlen_keep_mask gives each
    # sequence's block (lengths not multiples of 16, so the later sequences' patches start mid-way through a 16)
    from attention.reference.naive import naive_attention

    _, dropout = _flash()
    torch.manual_seed(42)
    p, lengths_q, lengths_k = 0.3, [13, 1, 30], [20, 7, 30]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    q = torch.randn(sum(lengths_q), 4, 16, dtype=torch.float16)
    k, v = (torch.randn(sum(lengths_k), 2, 16, dtype=torch.float16) for _ in range(2))
    do = torch.randn_like(q)
    with dropout.recording() as seeds:
        ours = _out_and_grads(lambda q, k, v: attention_varlen(q, k, v, cu_q, cu_k, 30, 30, dropout_p=p, causal=True),
                              (q, k, v), do)
    keep = dropout.varlen_keep_mask(seeds[0], 4, cu_q, cu_k, p)

    def reference(q, k, v):
        pieces = []
        for (q0, q1), (k0, k1) in zip(zip(cu_q.tolist(), cu_q.tolist()[1:]), zip(cu_k.tolist(), cu_k.tolist()[1:])):
            sq, sk, sv = (t[a:b].transpose(0, 1)[None] for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
            y = naive_attention(sq, sk, sv, True, 16 ** -0.5, dropout_p=p, keep=keep[None, :, q0:q1, k0:k1])
            pieces.append(y[0].transpose(0, 1))
        return torch.cat(pieces)

    exact = _out_and_grads(reference, [t.double() for t in (q, k, v)], do.double())
    assert_errors_within(("out", "dq", "dk", "dv"), exact, _out_and_grads(reference, (q, k, v), do), ours)


def test_triton_qkvpacked_dropout_matches_the_unpacked_call():
    # the packed path draws its seed the same way: one manual_seed, the same mask, the same output and gradient
    torch.manual_seed(43)
    packed = torch.randn(2, 37, 3, 2, 16, dtype=torch.float16)
    do = torch.randn(2, 2, 37, 16, dtype=torch.float16)
    results = []
    for call in (lambda t: attention_qkvpacked(t, backend="triton", dropout_p=0.25),
                 lambda t: attention(*(x.transpose(1, 2) for x in t.unbind(2)), backend="triton", dropout_p=0.25)):
        torch.manual_seed(0)
        results.append(_out_and_grads(call, (packed,), do))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_same_seed_same_mask_new_call_new_mask():
    torch.manual_seed(44)
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Tq=37, Tk=53, D=16, requires_grad=True)
    do = torch.randn_like(q)
    results = []
    for reseed in (True, True, False):
        if reseed:
            torch.manual_seed(7)
        results.append(_out_and_grads(lambda q, k, v: attention(q, k, v, backend="triton", dropout_p=0.3),
                                      (q, k, v), do))
    for first, again in zip(results[0], results[1]):
        assert torch.equal(first, again)  # the forward's mask and the backward's regenerated one, both reproduced
    assert not torch.equal(results[1][0], results[2][0])  # the next call draws a new seed


def test_keep_rate_is_one_minus_p_and_counters_differ_per_score():
    _, dropout = _flash()
    seed = torch.tensor([123456789012345], dtype=torch.int64)
    for p in (0.1, 0.5):
        keep = dropout.keep_mask(seed, 2, 3, 64, 200, p)  # 76800 draws
        n = keep.numel()
        rate = keep.float().mean().item()
        assert abs(rate - (1 - p)) < 4 * ((p * (1 - p) / n) ** 0.5), f"keep rate {rate} for p={p}"
    # no two batch rows, heads or rows repeat a mask (a counter that left one out would)
    assert not torch.equal(keep[0], keep[1]) and not torch.equal(keep[0, 0], keep[0, 1])
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])
    assert not torch.equal(keep, dropout.keep_mask(seed + 1, 2, 3, 64, 200, 0.5))


def _philox4x32(seed: int, counters: np.ndarray, rounds: int) -> np.ndarray:
    """Philox-4x32 (Salmon et al. 2011) of counters (..,) uint64 with (lo, hi, 0, 0) words, keyed by the seed's two
    halves: -> (4, ..) uint32, written from the paper to check the kernels' draws against."""
    mask = np.uint64(0xFFFFFFFF)
    c = [counters & mask, counters >> np.uint64(32), np.zeros_like(counters), np.zeros_like(counters)]
    k0, k1 = np.uint64(seed) & mask, np.uint64(seed) >> np.uint64(32)
    mul_a, mul_b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(rounds):
        prod_a, prod_b = mul_a * c[0], mul_b * c[2]  # 64-bit products of 32-bit words
        c = [(prod_b >> np.uint64(32)) ^ c[1] ^ k0, prod_b & mask, (prod_a >> np.uint64(32)) ^ c[3] ^ k1, prod_a & mask]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return np.stack(c).astype(np.uint32)


def test_keep_mask_is_philox_over_patches_of_eight_scores():
    # §16's scheme, computed here from its definition: rows {a, a + 8} by columns {c, c + 1, c + 8, c + 9} share the
    # Philox draw of counter (row0 + a) * n_cols + c, half a word a score; the Hopper kernels must draw the same
    _, dropout = _flash()
    seed, B, H, Tq, Tk, p = 987654321987, 2, 3, 40, 56, 0.3
    keep = dropout.keep_mask(torch.tensor([seed]), B, H, Tq, Tk, p).numpy()
    bh, r, j = np.meshgrid(np.arange(B * H), np.arange(Tq), np.arange(Tk), indexing="ij")
    a, c = 16 * (r // 16) + r % 8, 16 * (j // 16) + 2 * ((j % 8) // 2)
    counters = ((bh * Tq + a) * Tk + c).astype(np.uint64)
    words = _philox4x32(seed, counters, rounds=7)
    word = np.take_along_axis(words, (2 * ((r // 8) % 2) + (j // 8) % 2)[None], 0)[0]
    expected = ((word >> (16 * (j % 2))) & 0xFFFF) >= int(p * 65536)
    assert np.array_equal(keep.reshape(B * H, Tq, Tk), expected)


def test_dropout_p_zero_is_the_plain_kernel_bit_for_bit():
    from attention.flash import terms as flash_terms

    assert flash_terms.terms_of(dropout_p=0.0) is flash_terms.NO_TERMS
    torch.manual_seed(45)
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Tq=37, Tk=53, D=16, dtype=torch.float16)
    do = torch.randn_like(q)
    plain = _out_and_grads(lambda q, k, v: attention(q, k, v, backend="triton"), (q, k, v), do)
    zero = _out_and_grads(lambda q, k, v: attention(q, k, v, backend="triton", dropout_p=0.0), (q, k, v), do)
    for a, b in zip(plain, zero):
        assert torch.equal(a, b)


def test_dropout_compiles_in_only_where_used_and_takes_the_hopper_kernels():
    from attention.flash import terms as flash_terms

    q, k, v = qkv(D=16)
    assert flash_terms.term_args(flash_terms.NO_TERMS, False) == (None,) * 6
    terms = flash_terms.terms_of(dropout_p=0.1, dropout_seed=torch.zeros(1, dtype=torch.int64))
    for kernel in ("fwd", "dq", "dkdv"):
        assert flash_terms.term_constants(terms, q, v, kernel) == dict(DROPOUT=True)
    assert not flash_terms.plain_call(terms, q, v)
    # the Hopper kernels draw the `tl` kernels' mask (gluon_dropout), so either family may take either pass
    assert flash_terms.hopper_call(terms, q, v)


def test_launch_plans_take_each_calls_seed_and_p(monkeypatch):
    # the second and third calls of one layout run the first call's plan, each with its own seed and dropout_p
    taken = whole_paths(monkeypatch)
    for i, p in enumerate((0.2, 0.5, 0.5)):
        torch.manual_seed(46 + i)
        q, k, v = qkv(B=1, Hq=2, Hkv=1, Tq=37, Tk=45, D=16, dtype=torch.float16)
        assert_dropout_matches_fp64(q, k, v, True, p=p)
    assert taken == ["_forward_plan", "_backward_plan"]


@pytest.mark.parametrize("backend", ["naive", "compile", "sdpa"])
def test_reference_backends_drop_their_probabilities(backend):
    # torch's own dropout on P (naive, compile) or sdpa's dropout_p: reproducible, a new mask per call, and the
    # expected output is the undropped one (here the mean over many dropped rows of ones: every row's sum of P is 1)
    torch.manual_seed(47)
    q, k, _ = qkv(B=1, Hq=2, Hkv=2, Tq=8, Tk=400, D=16)
    v = torch.ones_like(k)
    outs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        outs.append(attention(q, k, v, causal=False, backend=backend, dropout_p=0.5))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    assert abs(outs[0].mean().item() - 1) < 0.15
    assert torch.equal(attention(q, k, v, causal=False, backend=backend, dropout_p=0.0), attention(q, k, v, False,
                                                                                                    backend=backend))


@pytest.mark.parametrize("call, message", [
    (dict(dropout_p=1.0), "dropout_p must be a number in [0, 1)"),
    (dict(dropout_p=-0.1), "dropout_p must be a number in [0, 1)"),
    (dict(dropout_p=True), "dropout_p must be a number in [0, 1)"),
    (dict(dropout_p=0.1, backend="flex"), "backend 'flex' does not compute dropout_p; use one of: compile, naive, "
                                          "sdpa, triton"),
])
def test_bad_dropout_fails_in_one_line(call, message):
    q, k, v = qkv(Tq=8, Tk=8, D=16)
    with pytest.raises(ValueError) as error:
        attention(q, k, v, **{"backend": "triton", **call})
    assert message in str(error.value) and "\n" not in str(error.value)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    if "backend" not in call:
        with pytest.raises(ValueError, match="dropout_p must be"):
            attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 8, 8,
                             call["dropout_p"])


def test_ops_with_dropout_pass_opcheck():
    # the seed is the ops' last tensor argument: the same seed, the same mask in every run opcheck makes
    from attention.flash import terms as flash_terms
    from attention.flash.autograd import _op_args, flash_attn_bwd, flash_attn_fwd

    dispatch, dropout = _flash()
    torch.manual_seed(52)
    q, k, v = qkv(Hq=4, Hkv=2, Tq=20, Tk=24, D=16)
    seed = dropout.draw_seed(q.device)
    rest = _op_args(dispatch.DENSE, None, flash_terms.terms_of(dropout_p=0.3, dropout_seed=seed))
    torch.library.opcheck(flash_attn_fwd, (q, k, v, True, 0.25, *rest))
    out, lse = flash_attn_fwd(q, k, v, True, 0.25, *rest)
    torch.library.opcheck(flash_attn_bwd, (torch.randn_like(out), q, k, v, out, lse, True, 0.25, *rest))


def test_torch_compile_fullgraph_draws_a_seed_per_run():
    # the seed is a random op of the graph (not a constant traced into it): each run of the compiled graph drops
    # another mask, torch.manual_seed reproduces one, and the backward op reads the forward's seed. Under aot_eager the
    # graph draws it from the same generator as eager: the same output and gradients, bit for bit
    torch.manual_seed(48)
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Tq=20, Tk=20, D=16)
    do = torch.randn_like(q)

    def fn(q, k, v):
        return attention(q, k, v, backend="triton", dropout_p=0.3)

    def runs(f):
        results = []
        for seed in (3, 3, None):
            if seed is not None:
                torch.manual_seed(seed)
            results.append(_out_and_grads(f, (q, k, v), do))
        return results

    eager = runs(fn)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = runs(torch.compile(fn, fullgraph=True, backend=backend))
        for first, again in zip(compiled[0], compiled[1]):
            assert torch.equal(first, again), backend
        assert not torch.equal(compiled[1][0], compiled[2][0]), backend
        if backend == "aot_eager":
            for ours, theirs in zip(compiled[0], eager[0]):
                assert torch.equal(ours, theirs)


@pytest.mark.parametrize("attn", ["probe", "moba"])
def test_model_drops_attention_probabilities_in_training_only(monkeypatch, attn):
    # GPTConfig.dropout reaches attention() as dropout_p in training, as nanoGPT's does, where the backend computes it
    from model import GPT, GPTConfig

    seen = []

    def probe(q, k, v, causal, scale, dropout_p=0.0, **rest):
        seen.append(dropout_p)
        return get_backend("naive").fn(q, k, v, causal=causal, scale=scale, dropout_p=dropout_p, **rest)

    registered_backend(monkeypatch, "probe", probe, supports_masks=True, terms=frozenset({"dropout_p"}))
    config = dict(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32, dropout=0.2, attn=attn)
    model = GPT(GPTConfig(**config, **({"attn_options": {"moba_block": 16, "moba_topk": 1}} if attn == "moba" else {})))
    assert model.transformer.h[0].attn.attn_dropout == (0.2 if attn == "probe" else 0.0)  # MoBA: the residual only
    if attn == "probe":
        idx = torch.randint(64, (1, 16))
        model.train()(idx)
        model.eval()(idx)
        assert seen == [0.2, 0.0]


# ---------------------------------------------------------------------------------------------------------------------
# GPU: the compiled kernels in bf16 and fp16 at training sizes (skipped without CUDA, conftest.py)


@pytest.mark.gpu
@pytest.mark.usefixtures("default_tiles")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D, causal, Tq, Tk", [(64, True, 1024, 1024), (128, False, 1000, 1000),
                                               (24, True, 300, 1000), (64, True, 1000, 300)])
def test_gpu_dropout_matches_fp64_with_its_mask(dtype, D, causal, Tq, Tk):
    torch.manual_seed(49)
    q, k, v = qkv(2, 8, 2, Tq, Tk, D, dtype, device="cuda")
    _, keep = assert_dropout_matches_fp64(q, k, v, causal, p=0.1)
    n = keep.numel()
    assert abs(keep.float().mean().item() - 0.9) < 4 * (0.09 / n) ** 0.5


@pytest.mark.gpu
@pytest.mark.usefixtures("default_tiles")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_dropout_with_masks_and_terms_matches_fp64(dtype):
    torch.manual_seed(50)
    q, k, v = qkv(2, 4, 2, 777, 777, 64, dtype, device="cuda")
    assert_dropout_matches_fp64(q, k, v, True, p=0.2, window=(100, 0), sinks=torch.randn(4, device="cuda"),
                                softcap=20.0)


@pytest.mark.gpu
@pytest.mark.usefixtures("default_tiles")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D, causal, Tq, Tk", [(64, True, 1000, 1000), (128, False, 777, 777), (64, True, 300, 1000),
                                               (128, True, 1000, 300)])
def test_gpu_hopper_kernels_draw_the_tl_mask(monkeypatch, dtype, D, causal, Tq, Tk):
    # NANOFLASH_HOPPER=1: the Hopper forward and backward drop P by §16's patches (gluon_dropout), against float64
    # with the mask keep_mask gives (the `tl` kernels' debug path), alone and with the terms; with sinks and softcap
    # the backward is the `tl` one, which regenerates the Hopper forward's mask
    dispatch, _ = _flash()
    taken = spy_on_hopper_kernels(monkeypatch)
    monkeypatch.setattr(dispatch, "HOPPER_MODE", "1")
    torch.manual_seed(51)
    q, k, v = qkv(2, 8, 2, Tq, Tk, D, dtype, device="cuda")
    sinks, slopes = torch.randn(8, device="cuda"), torch.rand(8, device="cuda")
    for terms in ({}, dict(sinks=sinks, alibi_slopes=slopes), dict(softcap=20.0, sinks=sinks, alibi_slopes=slopes)):
        taken.clear()
        assert_dropout_matches_fp64(q, k, v, causal, p=0.15, **terms)
        assert [kind for kind, *_ in taken] == (["fwd"] if "softcap" in terms else ["fwd", "bwd"]), taken
        for _, args, _ in taken:  # dropout_p and the seed reached the kernels
            assert args[6] == 0.15 and args[7] is not None


@pytest.mark.gpu
@pytest.mark.usefixtures("default_tiles")
def test_gpu_torch_compile_fullgraph_draws_a_seed_per_run():
    torch.manual_seed(51)
    q, k, v = qkv(2, 8, 8, 512, 512, 64, torch.bfloat16, device="cuda")
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, backend="triton", dropout_p=0.1), fullgraph=True)
    outs = []
    for seed in (3, 3, None):
        if seed is not None:
            torch.manual_seed(seed)
        outs.append(compiled(q, k, v))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
