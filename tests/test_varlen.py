"""attention_varlen (§14): packed sequences against float64, forward and every gradient; the contract's checks; the
GPU kernels in fp16/bf16 without a host synchronisation."""
import pytest
import torch
import torch.nn.functional as F

from attention import attention, attention_varlen
from helpers import assert_fn_matches_fp64


def offsets(lengths: list[int], device="cpu") -> torch.Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32).to(device)


def packed(lengths_q, lengths_k, Hq=2, Hkv=1, D=16, dtype=torch.float32, device="cpu"):
    """Fresh random q (total_q, Hq, D), k, v (total_k, Hkv, D) and the call's cu_seqlens / max_seqlen arguments."""
    q = torch.randn(sum(lengths_q), Hq, D, dtype=dtype, device=device)
    k, v = (torch.randn(sum(lengths_k), Hkv, D, dtype=dtype, device=device) for _ in range(2))
    seqs = (offsets(lengths_q, device), offsets(lengths_k, device), max(lengths_q), max(lengths_k))
    return q, k, v, seqs


def assert_varlen_matches_fp64(lengths_q, lengths_k, backend="triton", **kwargs):
    q, k, v, seqs = packed(lengths_q, lengths_k, **{n: kwargs.pop(n) for n in ("Hq", "Hkv", "D", "dtype", "device")
                                                    if n in kwargs})

    def call(name):
        return lambda q, k, v: attention_varlen(q, k, v, *seqs, backend=name, **kwargs)
    return assert_fn_matches_fp64(call(backend), call("naive"), q, k, v)


# the interpreter's tiles are 16..32 rows: these lengths hit empty, single-row, ragged and multi-tile sequences
LENGTHS = [5, 40, 1, 33, 0, 70]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2), (3, 1)])
def test_varlen_matches_fp64(causal, Hq, Hkv):
    torch.manual_seed(0)
    assert_varlen_matches_fp64(LENGTHS, LENGTHS, causal=causal, Hq=Hq, Hkv=Hkv)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_fewer_queries_than_keys(causal):
    # each sequence's queries are its last positions (a prompt continuing over its own cache), and a sequence may
    # have queries but no keys (its rows are 0) or keys but no queries
    torch.manual_seed(1)
    assert_varlen_matches_fp64([3, 17, 0, 30, 2], [9, 20, 4, 30, 0], causal=causal, Hq=4, Hkv=2)


@pytest.mark.parametrize("backend", ["triton", "naive"])
def test_varlen_without_queries_or_keys_returns_zeros_with_zero_gradients(backend):
    # every sequence empty, or queries that have no keys: outputs 0, and the gradient reaches q as zeros
    for lengths_q, lengths_k in (([0, 0], [0, 0]), ([3], [0])):
        q, k, v, seqs = packed(lengths_q, lengths_k)
        q.requires_grad_()
        y = attention_varlen(q, k, v, *seqs, causal=True, backend=backend)
        y.sum().backward()
        assert y.shape == q.shape and not y.any() and not q.grad.any()


@pytest.mark.parametrize("causal,window", [(True, (7, -1)), (True, (20, 0)), (False, (7, 5)), (False, (-1, 3)),
                                           (False, (0, 0))])
def test_varlen_window_matches_fp64(causal, window):
    torch.manual_seed(2)
    assert_varlen_matches_fp64(LENGTHS, LENGTHS, causal=causal, window_size=window)


def test_varlen_fp16_and_scale():
    torch.manual_seed(3)
    assert_varlen_matches_fp64([9, 31, 2], [9, 31, 2], causal=True, dtype=torch.float16, D=24, softmax_scale=0.3)


def test_varlen_is_attention_within_documents():
    # the same computation as attention() on one row of packed documents with document_ids
    torch.manual_seed(4)
    lengths = [7, 1, 25, 12]
    q, k, v, seqs = packed(lengths, lengths, Hq=2, Hkv=2)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None].to(torch.int32)
    expected = attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), causal=True, backend="naive",
                         document_ids=ids)[0].transpose(0, 1)
    got = attention_varlen(q, k, v, *seqs, causal=True, backend="triton")
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=0)


def test_varlen_compiles_without_graph_breaks():
    torch.manual_seed(5)
    q, k, v, seqs = packed([5, 19, 8], [5, 19, 8])
    fn = torch.compile(lambda q, k, v: attention_varlen(q, k, v, *seqs, causal=True), fullgraph=True, backend="eager")
    torch.testing.assert_close(fn(q, k, v), attention_varlen(q, k, v, *seqs, causal=True), atol=0, rtol=0)


@pytest.mark.parametrize("change,message", [
    (lambda a: {**a, "q": a["q"][None]}, "must be 3-D"),
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].long()}, "int32"),
    (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"][:-1]}, "the same sequences"),
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].flip(0)}, "start at 0"),
    (lambda a: {**a, "max_seqlen_q": 3}, "max_seqlen"),
    (lambda a: {**a, "max_seqlen_k": 40.0}, "Python int"),
    (lambda a: {**a, "dropout_p": 1.0}, "dropout_p must be a number in"),
    (lambda a: {**a, "window_size": (5,)}, "window"),
    (lambda a: {**a, "k": a["k"][:, :, :8], "v": a["v"][:, :, :8]}, "head_dim"),
    (lambda a: {**a, "backend": "moba"}, "no varlen path"),
])
def test_varlen_refuses_bad_input(change, message):
    q, k, v, (cu_q, cu_k, max_q, max_k) = packed([5, 19], [5, 19])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    with pytest.raises((ValueError, TypeError), match=message):
        attention_varlen(**change(args))


# ---------------------------------------------------------------------------------------------------------------------
# GPU: the compiled kernels in half precision, and no host synchronisation


@pytest.mark.gpu
@pytest.mark.usefixtures("default_tiles")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (256, 0))])
def test_varlen_gpu_matches_fp64(dtype, D, causal, window):
    torch.manual_seed(6)
    lengths = [1, 700, 129, 2000, 63, 0, 1031]
    assert_varlen_matches_fp64(lengths, lengths, causal=causal, window_size=window, Hq=8, Hkv=2, D=D, dtype=dtype,
                               device="cuda")


@pytest.mark.gpu
@pytest.mark.usefixtures("default_tiles")
def test_varlen_gpu_never_waits_for_the_gpu():
    torch.manual_seed(7)
    q, k, v, seqs = packed([300, 17, 900], [300, 17, 900], Hq=4, Hkv=4, D=64, dtype=torch.bfloat16, device="cuda")
    q.requires_grad_()

    def step():
        attention_varlen(q, k, v, *seqs, causal=True).sum().backward()

    step()  # the first call of a shape compiles and chooses its tiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
