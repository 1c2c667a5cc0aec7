"""The "flex" backend (attention/reference/flex.py): PyTorch's FlexAttention with our masks, against float64 by the criterion of
helpers.py. On CPU FlexAttention runs eagerly and has no backward, so the CPU tests check the forward (float32 and
float64); the GPU tests run the compiled kernels, forward and gradients."""
import gc
import weakref

import pytest
import torch
from helpers import assert_errors_within, assert_matches_fp64, packed_document_ids, qkv

import attention.reference.flex as flex
from attention import BlockMask, attention, get_backend
from attention.masks import dense_mask, mask_fn_mask


def _blind_rows_per_head(b, h, q_idx, kv_idx):  # every fifth query sees no key at all
    return (q_idx % 5 != 0) & ((q_idx + kv_idx + h) % 3 != 0)


# name -> (qkv sizes, causal, rules(device) -> attention()'s mask keywords); odd lengths leave ragged blocks
CASES = {
    "causal": (dict(Tq=37, Tk=37), True, lambda device: {}),
    "not causal": (dict(Tq=70, Tk=70), False, lambda device: {}),
    "gqa": (dict(B=2, Hq=6, Hkv=2, Tq=70, Tk=70, D=16), True, lambda device: {}),
    "fewer queries": (dict(Tq=5, Tk=70), True, lambda device: {}),  # bottom-right: the queries are the last 5
    "more queries": (dict(Tq=40, Tk=10), True, lambda device: {}),  # the first 30 queries see no key
    "window": (dict(Hq=4, Hkv=2, Tq=70, Tk=70), True, lambda device: {"window": (8, 0)}),
    "window both sides": (dict(Tq=37, Tk=37), False, lambda device: {"window": (5, 3)}),
    "window fewer queries": (dict(Tq=20, Tk=70), True, lambda device: {"window": (10, 0)}),
    "window one query": (dict(Hq=4, Hkv=2, Tq=1, Tk=70), True, lambda device: {"window": (16, 0)}),  # decoding
    "documents": (dict(B=2, Hq=4, Hkv=1, Tq=70, Tk=70, D=16), True, lambda device: {
        "document_ids": packed_document_ids(2, 70, [[1, 20, 1, 1, 30, 40], [9, 1, 61]]).to(device)}),
    "documents window fewer queries": (dict(B=2, Tq=30, Tk=70), True, lambda device: {
        "document_ids": packed_document_ids(2, 70, [[33, 1, 36], [50, 1, 1, 18]]).to(device), "window": (6, 0)}),
    "mask_fn with blind rows": (dict(B=2, Hq=3, Hkv=3, Tq=37, Tk=37), True, lambda device: {
        "block_mask": BlockMask.from_mask_fn(_blind_rows_per_head, 1, 3, 37, 37, device=device)}),
    "layout": (dict(Tq=37, Tk=70), False, lambda device: {
        "block_mask": BlockMask.from_layout(torch.tensor([[1, 0, 1, 0, 1], [0, 1, 1, 0, 0], [1, 1, 0, 0, 1]],
                                                         dtype=torch.bool, device=device), 37, 70, block_size=16)}),
}


def assert_forward_matches_fp64(q, k, v, causal, **rules):
    """attention(..., backend="flex")'s output against float64, judged by the naive backend in q's dtype."""
    def out(backend, *tensors):
        return attention(*tensors, causal, backend=backend, **rules)

    exact = out("naive", q.double(), k.double(), v.double())
    ours = out("flex", q, k, v)
    assert ours.dtype == q.dtype
    assert_errors_within(["out"], [exact], [out("naive", q, k, v)], [ours])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_fp64_on_cpu(case, dtype):
    sizes, causal, rules = CASES[case]
    assert_forward_matches_fp64(*qkv(**sizes, dtype=dtype, seed=0), causal, **rules("cpu"))


@pytest.mark.parametrize("rules", [
    dict(causal=True),
    dict(causal=False, window=(4, 2)),
    dict(causal=True, window=(3, -1), document_ids=packed_document_ids(2, 23, [[1, 7, 1, 14], [23]])),
])
def test_mask_mod_is_the_rules_of_masks_py(rules):
    for Tq, Tk in ((23, 23), (9, 23)):  # the queries are the last Tq positions
        expected = dense_mask(Tq, Tk, batch=2, **rules).expand(2, 1, Tq, Tk)
        got = mask_fn_mask(flex.flex_mask_mod(**rules, query_offset=Tk - Tq), 2, 1, Tq, Tk).expand(2, 1, Tq, Tk)
        assert torch.equal(got, expected), (Tq, Tk)


def test_flex_masks_are_built_once_and_go_with_the_block_mask(monkeypatch):
    built, create = [], flex.create_block_mask
    monkeypatch.setattr(flex, "create_block_mask", lambda *args, **kwargs: built.append(1) or create(*args, **kwargs))
    q, k, v = qkv(Tq=41, Tk=41, seed=0)
    ids = torch.tensor([[0] * 20 + [1] * 21])  # a step's documents: a mask of its own, as a model builds per step
    mask = BlockMask.from_rules(41, 41, causal=True, window=(8, 0), document_ids=ids)
    for _ in range(3):  # as the layers of one step
        attention(q, k, v, backend="flex", block_mask=mask)
        attention(q, k, v, backend="flex", causal=True)
    assert len(built) == 2  # one for the BlockMask, one for dense causal attention at this shape
    kept = weakref.ref(mask)
    del mask
    gc.collect()
    assert kept() is None


def test_backend_says_what_it_takes():
    spec = get_backend("flex")
    assert (spec.exact, spec.supports_masks, spec.kv_cache, spec.packed, dict(spec.options)) == (True, True, True,
                                                                                                 False, {})


def test_gradients_on_cpu_name_the_way_out():
    q, k, v = qkv(requires_grad=True)
    with pytest.raises(NotImplementedError, match="backend 'flex' has no backward on CPU .*train on CUDA"):
        attention(q, k, v, backend="flex")


@pytest.fixture
def fresh_compile():
    """Dynamo forgets the graphs of earlier tests: past its recompile limit a new shape would run FlexAttention
    eagerly instead of compiling its kernels."""
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.usefixtures("fresh_compile")
def test_forward_and_gradients_match_fp64_on_cuda(case):
    sizes, causal, rules = CASES[case]
    assert_matches_fp64(*qkv(**sizes, device="cuda", seed=0), causal, backend="flex", **rules("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["window", "documents"])
@pytest.mark.usefixtures("fresh_compile")
def test_bfloat16_at_training_sizes_on_cuda(family):
    if family == "window":
        rules = {"window": (256, 0)}
    else:
        rules = {"document_ids": packed_document_ids(2, 2000, [[700, 1, 1299], [129, 1, 1870]]).cuda()}
    assert_matches_fp64(*qkv(B=2, Hq=4, Hkv=2, Tq=2000, Tk=2000, D=64, dtype=torch.bfloat16, device="cuda", seed=0),
                        True, backend="flex", **rules)


@pytest.mark.gpu
@pytest.mark.usefixtures("fresh_compile")
def test_compiled_caller_matches_eager_on_cuda():
    # train.py --compile: the model's graph traces the backend, building the Flex mask inside it
    ids = packed_document_ids(2, 130, [[40, 1, 89], [130]]).cuda()

    def layer(q, k, v):
        return attention(q, k, v, backend="flex", document_ids=ids, window=(32, 0))

    q, k, v = qkv(B=2, Hq=4, Hkv=2, Tq=130, Tk=130, D=32, device="cuda", seed=0)
    do = torch.randn_like(q)
    results = []
    for fn in (layer, torch.compile(layer)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        results.append((out, *torch.autograd.grad(out, leaves, do)))
    for direct, traced in zip(*results):
        torch.testing.assert_close(traced, direct, rtol=1e-5, atol=1e-5)
