"""FlashAttention's terms (issue 47, docs/flash_attention.md §15) on the GPU: the compiled kernels in bf16 and fp16 at
training sizes against float64, alone and with masks, documents and varlen, on the Hopper kernels where they take
them, and under torch.compile (skipped without CUDA, conftest.py). The CPU tests are in test_terms.py."""
import pytest
import torch
import torch.nn.functional as F
from helpers import (TERM_CASES, assert_compiled_like_eager, assert_terms_match_fp64, packed_document_ids, qkv,
                     slopes_for, spy_on_hopper_kernels, terms_for)

from attention import attention


GPU_SHAPES = [  # D, Dv, causal, Tq, Tk
    (64, 64, True, 1024, 1024),  # GPT-2's head
    (128, 128, False, 1000, 1000),  # ragged last tile
    (192, 128, True, 777, 777),  # MLA's head dims
    (24, 16, True, 300, 1000),  # tiny heads, padded; Tq < Tk
    (64, 32, True, 1000, 300),  # Tq > Tk: 700 rows see no key
]


@pytest.mark.gpu
@pytest.mark.usefixtures("default_tiles")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", TERM_CASES)
@pytest.mark.parametrize("D, Dv, causal, Tq, Tk", GPU_SHAPES)
def test_gpu_terms_match_fp64(dtype, case, D, Dv, causal, Tq, Tk):
    torch.manual_seed(21)
    q, k, _ = qkv(2, 8, 2, Tq, Tk, D, dtype, device="cuda")
    v = torch.randn(2, 2, Tk, Dv, dtype=dtype, device="cuda")
    assert_terms_match_fp64(q, k, v, causal, **terms_for(case, 2, 8, "cuda"))


@pytest.mark.gpu
@pytest.mark.usefixtures("default_tiles")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masks", ["window", "documents"])
def test_gpu_terms_with_masks_match_fp64(dtype, masks):
    torch.manual_seed(22)
    q, k, _ = qkv(2, 8, 2, 999, 999, 64, dtype, device="cuda")
    v = torch.randn(2, 2, 999, 32, dtype=dtype, device="cuda")
    rules = ({"window": (256, 0)} if masks == "window" else
             {"document_ids": packed_document_ids(2, 999, [[100, 1, 500, 398], [999]]).cuda()})
    assert_terms_match_fp64(q, k, v, True, **rules, **terms_for("all", 2, 8, "cuda"))


@pytest.mark.gpu
@pytest.mark.usefixtures("default_tiles")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_varlen_terms_match_fp64(dtype):
    torch.manual_seed(23)
    lengths = [1, 700, 129, 0, 1031]
    q = torch.randn(sum(lengths), 8, 128, dtype=dtype, device="cuda")
    k = torch.randn(sum(lengths), 2, 128, dtype=dtype, device="cuda")
    v = torch.randn(sum(lengths), 2, 64, dtype=dtype, device="cuda")
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32).cuda()
    assert_terms_match_fp64(q, k, v, True, varlen=(cu, cu, 1031, 1031), **terms_for("all", 5, 8, "cuda"))


@pytest.mark.gpu
@pytest.mark.usefixtures("default_tiles")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D, causal, Tq, Tk", [
    (64, True, 1024, 1024),  # GPT-2's head; the first warpgroup's half tiles at the diagonal (§12)
    (128, False, 1000, 1000),  # ragged last tile; hs=128's backward (softcap: S^T from zero, dP^T late)
    (64, True, 1000, 300),  # Tq > Tk: 700 rows see no key (lse the sink's, or +inf)
    (128, True, 300, 1000),  # Tq < Tk: ALiBi's rows placed bottom-right among the keys
])
def test_gpu_terms_take_the_hopper_kernels(monkeypatch, dtype, D, causal, Tq, Tk):
    # NANOFLASH_HOPPER=1 takes the Hopper kernels wherever they can run: each term through both of them (§15), against
    # float64; with sinks and softcap together the forward only (dispatch._backward_plan)
    from attention.flash import dispatch

    taken = spy_on_hopper_kernels(monkeypatch)
    monkeypatch.setattr(dispatch, "HOPPER_MODE", "1")
    torch.manual_seed(24)
    q, k, v = qkv(2, 8, 2, Tq, Tk, D, dtype, device="cuda")
    for case in [*TERM_CASES, "alibi and sinks"]:
        taken.clear()
        terms = terms_for(case, 2, 8, "cuda")
        assert_terms_match_fp64(q, k, v, causal, **terms)
        backward = ["bwd"] if "sinks" not in terms or "softcap" not in terms else []
        assert [kind for kind, *_ in taken] == ["fwd"] + backward, (case, taken)
        for _, args, _ in taken:
            assert (args[0] is not None) == ("softcap" in terms)
            assert (args[1] is not None) == ("alibi_slopes" in terms)
        assert (taken[0][1][4] is not None) == ("sinks" in terms)
    # a value head dim of its own stays on the `tl` kernels
    taken.clear()
    assert_terms_match_fp64(q, k, v[..., :32].contiguous(), causal, softcap=2.0)
    assert taken == []


@pytest.mark.gpu
@pytest.mark.usefixtures("default_tiles")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_terms_with_documents_take_the_hopper_kernels(monkeypatch, dtype, D):
    # §14's documents on the Hopper kernels, with every term
    from attention.flash import dispatch

    taken = spy_on_hopper_kernels(monkeypatch)
    monkeypatch.setattr(dispatch, "HOPPER_MODE", "1")
    torch.manual_seed(27)
    q, k, v = qkv(2, 8, 2, 999, 999, D, dtype, device="cuda")
    ids = packed_document_ids(2, 999, [[100, 1, 500, 398], [999]]).cuda()
    assert_terms_match_fp64(q, k, v, True, document_ids=ids, **terms_for("all", 2, 8, "cuda"))
    # "all" has sinks and softcap: the backward on the `tl` kernels
    assert [(kind, documents is not None) for kind, _, documents in taken] == [("fwd", True)], taken
    taken.clear()
    assert_terms_match_fp64(q, k, v, True, document_ids=ids, **terms_for("alibi and sinks", 2, 8, "cuda"))
    assert [(kind, documents is not None) for kind, _, documents in taken] == [("fwd", True), ("bwd", True)], taken
    taken.clear()
    assert_terms_match_fp64(q, k, v, True, document_ids=ids, softcap=20.0, alibi_slopes=slopes_for(2, 8).cuda())
    assert [(kind, documents is not None) for kind, _, documents in taken] == [("fwd", True), ("bwd", True)], taken


@pytest.mark.gpu
@pytest.mark.usefixtures("default_tiles")
def test_gpu_torch_compile_fullgraph_with_terms():
    torch.manual_seed(25)
    q, k, _ = qkv(2, 8, 2, 512, 512, 64, torch.bfloat16, device="cuda")
    v = torch.randn(2, 2, 512, 32, dtype=torch.bfloat16, device="cuda")
    sinks, slopes = torch.randn(8, device="cuda"), slopes_for(2, 8, per_batch=True).cuda()

    def fn(q, k, v, sinks):
        return attention(q, k, v, backend="triton", softcap=30.0, alibi_slopes=slopes, sinks=sinks)

    assert_compiled_like_eager(fn, (q, k, v, sinks), tol=2e-2)
