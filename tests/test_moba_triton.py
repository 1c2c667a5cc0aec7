"""The fused MoBA kernels (attention/moba/tl_kernels.py) against float64, forward and backward, on the CPU
interpreter (small blocks) and, marked gpu, at training sizes in bf16, on an sm_90 GPU through the Hopper kernels
(moba/hopper.py, whose layout is checked on the CPU too) and the `tl` ones; and the same kernels as the
"moba" backend of attention() and attention_qkvpacked()."""
import pytest
import torch
from helpers import assert_fn_matches_fp64, assert_matches_fp64, assert_qkvpacked_matches_fp64, packed_qkv, qkv

from attention import attention, unpack_qkv
from attention.moba import op as moba_op
from attention.moba.reference import block_means, moba_attention, moba_mask, moba_select
from attention.reference.naive import naive_attention
from attention.moba.tl_kernels import entry_lists, merge_slots, moba_gate, work_items
from attention.moba.hopper import ROW_TILE, entry_layout
from attention.moba.op import moba_triton


def assert_moba_matches_fp64(B, Hq, Hkv, T, D, block_size, topk, dtype, device="cpu"):
    """The kernels' out, dq, dk, dv by the float64 criterion (helpers.py), judged by the dense reference of the same
    selection (naive attention under its mask) in the same dtype; the selection made once (on the float64 inputs)
    so every run attends to the same blocks."""
    torch.manual_seed(0)
    q, k, v = qkv(B, Hq, Hkv, T, T, D, dtype, device)
    selection = moba_select(q.double(), k.double(), block_size, topk)
    visible = moba_mask(selection, block_size, T)
    scale = D ** -0.5

    def reference(*t):
        return naive_attention(*t, causal=True, scale=scale, visible=visible)

    assert_fn_matches_fp64(lambda *t: moba_triton(*t, selection, block_size, scale), reference, q, k, v)


@pytest.mark.parametrize(
    "B, Hq, Hkv, T, D, topk, dtype",
    [
        (2, 4, 2, 100, 16, 2, torch.float32),  # GQA, last block 4 keys long
        (1, 2, 1, 130, 32, 1, torch.float16),
        (1, 2, 2, 64, 16, 3, torch.float32),  # topk larger than the past: empty slots
        (1, 1, 1, 20, 16, 2, torch.float32),  # one block: plain causal attention
    ],
)
def test_moba_matches_fp64(B, Hq, Hkv, T, D, topk, dtype):
    # the interpreter's tiles are 16-32 rows: 32-key blocks have several tiles of entries each
    assert_moba_matches_fp64(B, Hq, Hkv, T, D, 32, topk, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moba_own_block_tile_skipping_matches_fp64(dtype):
    # 64-key blocks hold two of the interpreter's 32-row tiles: the forward's and dQ's second own-query
    # tile reads the block's first 32 keys unmasked, and the dK/dV kernel's second key tile skips the 32
    # own rows before it, as the dense causal kernel does; T = 150 leaves a ragged last block of 22 keys
    assert_moba_matches_fp64(1, 2, 1, 150, 16, 64, 2, dtype)


def test_entry_lists_group_every_selected_pair_by_block():
    q, k, _ = qkv(2, 3, 3, 90, 90, 16, seed=0)
    selection = moba_select(q, k, 32, 2)  # (2, 3, 90, 3)
    order, first, count = entry_lists(selection, 32)
    S = selection.shape[-1]
    for bh in range(6):
        chosen = selection.reshape(6, -1)[bh]
        for block in range(3):
            entries = order[bh, first[bh, block]: first[bh, block] + count[bh, block]].long()
            assert torch.equal(entries, (chosen == block).nonzero().flatten())  # ascending query order
            assert (entries[: min(32, 90 - 32 * block)] // S // 32 == block).all()  # own queries first
    # every tile of every list gets exactly one work item; the rest are padding
    items = work_items(count, 90, S, 16)
    real = items[items[:, 0] < count.numel()]
    expected = sum((c + 15) // 16 for c in count.flatten().tolist())
    assert len(real) == expected and len(set(map(tuple, real.tolist()))) == expected


@pytest.mark.parametrize("B, Hq, Hkv, T, block_size, topk", [
    (2, 4, 2, 100, 32, 2),  # GQA, a ragged last block of 4
    (1, 3, 1, 300, 64, 3),  # a group of 3, segments of several tiles
    (1, 2, 2, 20, 32, 2),  # one block: own entries only
])
def test_hopper_layout_spans_are_moba(B, Hq, Hkv, T, block_size, topk):
    # the Hopper path's layout, emulated in float64: each row attends to its span of the B*Hkv*T keys; merging the
    # rows per query is MoBA; the key spans are the row spans seen from the keys; every forward tile's rows share
    # their first key, and its last row's span ends last
    D = 8
    q, k, v = (t.double() for t in qkv(B, Hq, Hkv, T, T, D, seed=0))
    selection = moba_select(q, k, block_size, topk)
    pos, src, row_spans, key_spans = (t.long() for t in entry_layout(selection, block_size, Hkv))
    n_rows, G = src.shape[0], Hq // Hkv
    real = src >= 0
    assert n_rows % ROW_TILE == 0
    assert torch.equal(src[pos[pos >= 0]], (torch.arange(B * Hq * T)[:, None].expand(-1, topk + 1)
                                            .reshape(pos.shape))[pos >= 0])  # each entry's row holds its query
    assert real.sum() == (selection >= 0).sum() and torch.equal(pos >= 0, selection >= 0)

    keys = torch.arange(B * Hkv * T)
    row_sees = (keys[None, :] >= row_spans[0, 0, :, None]) & (keys[None, :] < row_spans[0, 1, :, None])
    key_seen = (torch.arange(n_rows)[:, None] >= key_spans[0, 0]) & (torch.arange(n_rows)[:, None] < key_spans[0, 1])
    assert torch.equal(key_seen[real], row_sees[real]) and not key_seen[~real].any()
    first, end = row_spans[0].view(2, -1, ROW_TILE)
    assert (first == first[:, :1]).all() and (end <= end[:, -1:]).all()

    # the forward over the rows, then merge_slots (the kernel, in the interpreter) by log-sum-exp
    head = src.clamp(min=0) // T  # b * Hq + h
    q_rows = q.reshape(-1, D)[src.clamp(min=0)]
    k_rows = k.reshape(-1, D)  # (b, kv head, t) order
    s = (q_rows @ k_rows.T / D ** 0.5).masked_fill(~row_sees, float("-inf"))
    lse_rows = torch.logsumexp(s, -1)
    o_rows = torch.softmax(s, -1).nan_to_num() @ v.reshape(-1, D)
    assert torch.equal(head[real] // G, row_spans[0, 0, real] // T)  # a query head reads its kv head's keys
    out, lse = torch.empty_like(q), torch.empty(B, Hq, T, dtype=torch.float64)
    merge_slots(o_rows, lse_rows, pos.int(), out, lse)  # (it sums in float32)
    reference = naive_attention(q, k, v, causal=True, scale=D ** -0.5, visible=moba_mask(selection, block_size, T))
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)

    # the backward over the rows: each row's P against its query's merged lse and Delta, its dS K added into its
    # query's row (src), dK and dV summed over the rows that see each key
    do = torch.randn_like(q)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grads = torch.autograd.grad(naive_attention(q, k, v, causal=True, scale=D ** -0.5,
                                                visible=moba_mask(selection, block_size, T)), (q, k, v), do)
    q, k, v = (t.detach() for t in (q, k, v))
    rows = src.clamp(min=0)
    p = torch.exp(s - lse.flatten()[rows, None]) * real[:, None]
    do_rows = do.reshape(-1, D)[rows] * real[:, None]
    delta = (do * reference).sum(-1).flatten()[rows]
    ds = p * (do_rows @ v.reshape(-1, D).T - delta[:, None])
    dq = torch.zeros(B * Hq * T, D, dtype=torch.float64).index_add_(0, src[real], (ds @ k_rows)[real])
    for grad, expected in zip((dq * D ** -0.5, ds.T @ q_rows * D ** -0.5, p.T @ do_rows), grads):
        torch.testing.assert_close(grad.view(expected.shape), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["auto", "0"])  # on an sm_90 GPU the Hopper kernels, and the `tl` ones
@pytest.mark.parametrize(
    "B, Hq, Hkv, T, D, block_size, topk, dtype",
    [
        (1, 4, 2, 4096, 64, 512, 3, torch.bfloat16),
        (2, 4, 4, 3000, 128, 256, 2, torch.float16),  # ragged last block
        (1, 2, 1, 8192, 128, 512, 3, torch.bfloat16),
        (1, 6, 2, 1151, 128, 384, 4, torch.bfloat16),  # a group of 3, empty slots, a last block of 383
        (1, 2, 2, 300, 64, 512, 3, torch.float16),  # one block: own entries only
    ],
)
def test_moba_matches_fp64_gpu(B, Hq, Hkv, T, D, block_size, topk, dtype, kernels, monkeypatch):
    monkeypatch.setattr(moba_op, "HOPPER_MODE", kernels)
    assert_moba_matches_fp64(B, Hq, Hkv, T, D, block_size, topk, dtype, device="cuda")


def test_hopper_keys_are_read_in_place_where_each_heads_rows_are_whole_tiles():
    # §11 "Keys read where they are": a model's layout (views of one projection) is passed on as it is where T is a
    # multiple of the key tiles; otherwise k and v become one flat contiguous (1, 1, B*Hkv*T, D) sequence
    from attention.moba.hopper import key_tensors

    for T, in_place in ((256, True), (200, False)):
        _, k, v = unpack_qkv(packed_qkv(2, T, 3, 64, dtype=torch.float16))
        keys = key_tensors(k, v)
        if in_place:
            assert keys[0] is k and keys[1] is v
        else:
            assert [tuple(t.shape) for t in keys] == [(1, 1, 2 * 3 * T, 64)] * 2 and keys[0].is_contiguous()
            assert torch.equal(keys[0].view(2, 3, T, 64), k)
    # the kernels' key sizes: k's own; a gathered problem's one sequence, whose tiles must not straddle two heads
    from attention.flash.hopper.forward import key_problem

    assert key_problem(torch.empty(2, 3, 200, 64), False, 128) == (3, 200, (0, 0))
    assert key_problem(torch.empty(2, 3, 256, 64), True, 128) == (1, 2 * 3 * 256, (3, 256))
    assert key_problem(torch.empty(1, 1, 600, 64), True, 128) == (1, 600, (1, 600))  # flat: any length
    with pytest.raises(ValueError, match="must not straddle two heads"):
        key_problem(torch.empty(2, 3, 200, 64), True, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_moba_reads_a_models_layout_where_it_lies_gpu(D):
    # q, k, v transposed views of one (B, T, 3, H, D) tensor, as a model's fused projection leaves them: on Hopper the
    # kernels read k and v where they lie (each head's T rows are whole key tiles), and give what they give on
    # contiguous copies of the same numbers
    torch.manual_seed(0)
    views = unpack_qkv(packed_qkv(2, 2048, 4, D, dtype=torch.bfloat16, device="cuda"))
    copies = [t.contiguous() for t in views]
    selection = moba_select(*copies[:2], 512, 3)
    do = torch.randn_like(copies[0])
    results = []
    for tensors in (views, copies):
        leaves = [t.detach().requires_grad_() for t in tensors]  # the views keep their strides
        out = moba_triton(*leaves, selection, 512, D ** -0.5)
        results.append((out, *torch.autograd.grad(out, leaves, do)))
    (out, dq, dk, dv), (out_c, dq_c, dk_c, dv_c) = results
    assert not views[1].is_contiguous()
    assert torch.equal(out, out_c) and torch.equal(dk, dk_c) and torch.equal(dv, dv_c)
    torch.testing.assert_close(dq, dq_c)  # dQ's float32 adds land in any order (§13)


@pytest.mark.gpu
def test_moba_compiled_matches_eager():
    torch.manual_seed(0)
    q, k, v = qkv(1, 4, 4, 2048, 2048, 64, torch.bfloat16, "cuda", requires_grad=True)

    def step(q, k, v):
        return moba_attention(q, k, v, block_size=512, topk=2).float().square().sum()

    eager = torch.autograd.grad(step(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True)(q, k, v), (q, k, v))
    # the same kernels; on Hopper dQ's float32 adds land in any order (§13), so its last bits may differ
    torch.testing.assert_close(eager[0], compiled[0])
    for a, b in zip(eager[1:], compiled[1:]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("Hkv, T, topk, dtype", [(2, 100, 2, torch.float32), (4, 64, 5, torch.float32),
                                                 (1, 130, 1, torch.float32), (2, 100, 3, torch.float16)])
def test_fused_gate_selects_like_moba_select(Hkv, T, topk, dtype):
    # fp16: the scores from the means split in two (a 16-bit q is exact in TF32)
    q, k, _ = qkv(2, 4, Hkv, T, T, 16, dtype, seed=0)
    assert torch.equal(moba_gate(q, block_means(k, 16), 16, topk), moba_select(q, k, 16, topk))


@pytest.mark.gpu
def test_fused_gate_selects_like_moba_select_gpu():
    # bf16 inputs, scores in fp32 summed in a different order than cuBLAS's: near-ties may flip
    q, k, _ = qkv(1, 8, 8, 8192, 8192, 128, torch.bfloat16, "cuda", seed=0)
    same = moba_gate(q, block_means(k, 512), 512, 3) == moba_select(q, k, 512, 3)
    assert same.float().mean() > 0.999


# ---------------------------------------------------------------------------------------------
# the "moba" backend of attention(): the same kernels, the selection made inside


def moba_reference(block_size: int, topk: int):
    """MoBA's dense reference (moba_attention(backend="naive")): its selection as a (T, T) mask over naive
    attention, in the dtype it is given."""
    return lambda q, k, v: moba_attention(q, k, v, block_size, topk, backend="naive")


@pytest.mark.parametrize("Hq, Hkv, T, topk, dtype", [
    (2, 1, 96, 1, torch.float32),  # GQA; the last block's queries pick 1 of 2 earlier blocks
    (2, 2, 112, 2, torch.float16),  # a ragged last block of 16; empty slots in block 1, 2 of 3 past blocks in 3
])
def test_backend_matches_the_dense_reference_by_the_fp64_criterion(Hq, Hkv, T, topk, dtype):
    # blocks of 32, the interpreter's tile (a GPU takes multiples of 128)
    torch.manual_seed(0)
    q, k, v = qkv(1, Hq, Hkv, T, T, 16, dtype)
    # the float64 reference selects as the kernels do on these inputs (no near-tie flips)
    assert torch.equal(moba_select(q, k, 32, topk), moba_select(q.double(), k.double(), 32, topk))
    out, *_ = assert_matches_fp64(q, k, v, backend="moba", reference=moba_reference(32, topk), moba_block=32,
                                  moba_topk=topk)
    # the selection is sparse: dense causal attention differs
    assert not torch.allclose(out, attention(q, k, v, backend="naive"), atol=1e-2)


def test_packed_backend_matches_the_dense_reference_by_the_fp64_criterion():
    torch.manual_seed(0)
    qkv_packed = packed_qkv(1, 70, 2, 16)  # q, k, v: strided views of one tensor
    assert torch.equal(moba_select(*unpack_qkv(qkv_packed)[:2], 32, 1),
                       moba_select(*unpack_qkv(qkv_packed.double())[:2], 32, 1))
    out, dqkv = assert_qkvpacked_matches_fp64(
        qkv_packed, backend="moba", reference=lambda packed: moba_reference(32, 1)(*unpack_qkv(packed)),
        moba_block=32, moba_topk=1)
    assert dqkv.shape == qkv_packed.shape
    assert torch.equal(out, attention(*unpack_qkv(qkv_packed), backend="moba", moba_block=32, moba_topk=1))


def test_blocks_smaller_than_the_kernels_tiles_are_refused():
    q, k, v = qkv(1, 2, 2, 48, 48, 16)
    with pytest.raises(ValueError, match="block_size=16 is smaller than every tile of one of them; use a multiple "
                                         "of 128"):
        attention(q, k, v, backend="moba", moba_block=16)  # the interpreter's tiles are 32 and 16 rows
