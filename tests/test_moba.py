"""MoBA's block selection against its definition (own block first, past blocks only, top-k by
q . mean(k)), its mask, the dense references against a query-by-query float64 loop, and what the "moba"
backend of attention() refuses before any kernel runs. The Triton kernels: test_moba_triton.py."""
import pytest
import torch
from helpers import qkv

from attention import attention, get_backend
from attention.moba.reference import block_means, check_moba_options, check_same_length, moba_attention, moba_keys_per_query, moba_mask, moba_select


def _qkv(B=2, Hq=4, Hkv=2, T=70, D=8, dtype=torch.float64, seed=0):
    return qkv(B, Hq, Hkv, T, T, D, dtype, seed=seed)


def brute_force_selection(q, k, block_size, topk) -> list:
    """selection[b][h][t]: own block, then the topk past blocks by score, one query at a time."""
    B, Hq, T, _ = q.shape
    group = Hq // k.shape[1]
    out = []
    for b in range(B):
        per_head = []
        for h in range(Hq):
            keys = k[b, h // group]
            per_query = []
            for t in range(T):
                own = t // block_size
                scores = {n: float(q[b, h, t] @ keys[n * block_size:(n + 1) * block_size].mean(0)) for n in range(own)}
                best = sorted(scores, key=scores.get, reverse=True)[:topk]
                per_query.append([own, *best] + [-1] * (topk - len(best)))
            per_head.append(per_query)
        out.append(per_head)
    return out


@pytest.mark.parametrize("T, topk", [(70, 2), (64, 3), (40, 5)])
def test_selection_matches_a_query_by_query_loop(T, topk):
    q, k, _ = _qkv(T=T)
    selection = moba_select(q, k, block_size=16, topk=topk)
    assert selection.shape == (2, 4, T, topk + 1) and selection.dtype == torch.int64
    assert selection.tolist() == brute_force_selection(q, k, 16, topk)


def test_selection_own_block_first_then_distinct_past_blocks():
    q, k, _ = _qkv(T=100)  # 7 blocks of 16, the last one 4 keys long
    selection = moba_select(q, k, block_size=16, topk=3)
    own = torch.arange(100) // 16
    assert torch.equal(selection[..., 0], own.expand(2, 4, 100))
    chosen = selection[..., 1:]
    used = chosen >= 0
    assert (chosen[used] < own.expand(2, 4, 100)[..., None].expand_as(chosen)[used]).all()  # strictly past
    assert torch.equal(used.sum(-1), own.clamp(max=3).expand(2, 4, 100))  # min(topk, past blocks) used
    for row in chosen.reshape(-1, 3).tolist():
        real = [n for n in row if n >= 0]
        assert len(set(real)) == len(real) and row[len(real):] == [-1] * (3 - len(real))


def test_grouped_query_heads_read_their_kv_head():
    q, k, _ = _qkv(Hq=4, Hkv=2, T=48)
    assert torch.equal(moba_select(q, k, 16, 2), moba_select(q, k.repeat_interleave(2, dim=1), 16, 2))


def test_mask_from_a_hand_written_selection():
    # 6 keys in blocks of 2: query 5 (block 2) reads block 0; query 3 (block 1) reads nothing else
    selection = torch.tensor([[0, -1], [0, -1], [1, 0], [1, -1], [2, 0], [2, 0]])[None, None]
    visible = moba_mask(selection, block_size=2, Tk=6)[0, 0]
    assert ["".join("1" if x else "." for x in row) for row in visible.tolist()] == [
        "1.....",
        "11....",
        "111...",
        "..11..",
        "11..1.",
        "11..11",
    ]


def moba_loop(q, k, v, selection, block_size, scale):
    """Each query attends to the causal keys of its selected blocks, one at a time, in float64."""
    B, Hq, T, _ = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            for t in range(T):
                keys = [j for n in selection[b, h, t].tolist() if n >= 0
                        for j in range(n * block_size, min((n + 1) * block_size, t + 1))]
                weights = torch.softmax(k[b, h // group, keys] @ q[b, h, t] * scale, dim=0)
                out[b, h, t] = weights @ v[b, h // group, keys]
    return out


@pytest.mark.parametrize("backend", ["naive", "sdpa", "compile"])
def test_reference_backends_match_a_loop_over_the_selected_keys(backend):
    q, k, v = _qkv(T=52)
    expected = moba_loop(q, k, v, moba_select(q, k, 16, 2), 16, 0.25)
    got = moba_attention(q.float(), k.float(), v.float(), block_size=16, topk=2, scale=0.25, backend=backend)
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)


def test_gradients_flow_through_the_attention_to_q_k_v():
    q, k, v = (t.requires_grad_() for t in _qkv(T=48))
    moba_attention(q, k, v, block_size=16, topk=1, backend="naive").sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


def test_enough_blocks_is_dense_causal_and_none_is_block_local():
    q, k, v = _qkv(T=50)
    torch.testing.assert_close(moba_attention(q, k, v, block_size=16, topk=3, backend="naive"),
                               attention(q, k, v, causal=True, backend="naive"))
    local = moba_mask(moba_select(q, k, 16, 0), 16, 50)
    same_block = (torch.arange(50)[:, None] // 16) == (torch.arange(50)[None, :] // 16)
    assert torch.equal(local, (same_block & torch.ones(50, 50, dtype=torch.bool).tril()).expand(2, 4, 50, 50))


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"block_size": 8}, "moba_block must be an int >= 16"),
        ({"block_size": 16.0}, "moba_block must be an int >= 16"),
        ({"topk": -1}, "moba_topk must be an int >= 0"),
        ({"topk": True}, "moba_topk must be an int >= 0"),
        ({"backend": "flex"}, "backend 'triton' or a dense reference"),
    ],
)
def test_bad_arguments_name_the_fix(bad, match):
    q, k, v = _qkv(T=32)
    with pytest.raises(ValueError, match=match):
        moba_attention(q, k, v, **{"block_size": 16, "topk": 1, "backend": "naive", **bad})


def test_decoding_shapes_are_rejected():
    q, k, v = _qkv(T=32)
    with pytest.raises(ValueError, match="same length, got Tq=1 and Tk=32; for decoding"):
        moba_attention(q[:, :, -1:], k, v, block_size=16, backend="naive")
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        moba_select(q[:, :3], k, 16, 1)


def test_block_means_are_the_mean_key_of_each_block_the_last_one_shorter():
    _, k, _ = _qkv(T=40, dtype=torch.float32)  # blocks of 16, 16 and 8 keys
    means = block_means(k, 16)
    assert means.shape == (2, 2, 3, 8) and means.dtype == torch.float32
    expected = torch.stack([k[:, :, :16].mean(2), k[:, :, 16:32].mean(2), k[:, :, 32:].mean(2)], dim=2)
    torch.testing.assert_close(means, expected)
    assert block_means(k.half(), 16).dtype == torch.float32  # summed in float32 at least


def test_moba_checks_want_as_many_queries_as_keys_and_valid_options():
    q, k, _ = _qkv(T=32)
    check_same_length(q, k)  # passes
    check_moba_options(16, 1)
    with pytest.raises(ValueError, match="same length, got Tq=31 and Tk=32"):
        check_same_length(q[:, :, 1:], k)
    with pytest.raises(ValueError, match="moba_block must be an int >= 16"):
        check_moba_options(15, 1)
    with pytest.raises(ValueError, match="moba_block must be an int >= 16"):  # the public call checks them too
        moba_attention(q, k, k, block_size=15, topk=1, backend="naive")


def test_keys_per_query_is_its_own_block_and_topk_more():
    assert moba_keys_per_query() == 4 * 512  # the defaults: the paper's 512-key blocks, 3 earlier ones
    assert moba_keys_per_query(moba_block=128, moba_topk=0) == 128
    assert get_backend("moba").keys_per_query is moba_keys_per_query


# ---------------------------------------------------------------------------------------------
# the "moba" backend of attention(): what it refuses, before its kernels run


def test_the_backend_is_causal_self_attention_only():
    q, k, v = _qkv(T=64, D=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="MoBA is causal attention.*causal=True"):
        attention(q, k, v, causal=False, backend="moba", moba_block=32)
    with pytest.raises(ValueError, match="same length, got Tq=1 and Tk=64; for decoding"):
        attention(q[:, :, -1:], k, v, backend="moba", moba_block=32)  # a single query keeps its causal flag here


def test_the_backend_runs_the_kernels_so_it_takes_what_they_take():
    # moba_triton leaves the dtype and head-dim checks to its caller, the backend
    q, k, v = _qkv(T=64, D=16)
    with pytest.raises(TypeError, match="the triton attention kernels support float16, bfloat16 and float32, got "
                                        "torch.float64"):
        attention(q, k, v, backend="moba", moba_block=32)
    q, k, v = _qkv(T=64, D=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="the triton attention kernels support head_dim 16..256, got 8"):
        attention(q, k, v, backend="moba", moba_block=32)

