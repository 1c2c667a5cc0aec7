"""Block-sparse attention (§10 of docs/flash_attention.md): sliding windows, documents and block masks
in the Triton kernel, forward and backward against float64, through the CPU interpreter. The
interpreter's mask blocks are 32 wide (tiles 16/32), so T of 70-130 has skipped, full and partial
blocks and a ragged last one."""
import pytest
import torch
from helpers import assert_matches_fp64, packed_document_ids, qkv

from attention import BlockMask, attention
from attention.block_mask import FULL, PARTIAL, SKIP
from attention.masks import dense_mask


@pytest.mark.parametrize(
    "causal, window, Tq, Tk, dtype",
    [
        (True, (20, 0), 100, 100, torch.float16),  # a language model's sliding window
        (True, (45, -1), 130, 130, torch.float32),
        (False, (10, 30), 96, 96, torch.float16),  # both sides, whole blocks
        (False, (0, 0), 70, 70, torch.float32),  # each query sees only itself
        (True, (33, 0), 40, 110, torch.float16),  # Tq < Tk: new queries against a cache
        (False, (-1, 5), 77, 77, torch.float32),  # unbounded on the left
        (False, (7, -1), 90, 60, torch.float32),  # unbounded on the right, Tq > Tk: widest distance range
    ],
)
def test_sliding_window_matches_fp64(causal, window, Tq, Tk, dtype):
    torch.manual_seed(0)
    assert_matches_fp64(*qkv(B=2, Hq=4, Hkv=2, Tq=Tq, Tk=Tk, D=32, dtype=dtype), causal=causal, window=window)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_documents_match_fp64(dtype):
    torch.manual_seed(0)
    ids = packed_document_ids(2, 110, [[30, 50, 40], [7, 64, 1, 50]])  # odd lengths, a 1-token document
    assert_matches_fp64(*qkv(B=2, Hq=2, Hkv=1, Tq=110, Tk=110, D=16, dtype=dtype), causal=True, document_ids=ids)


def test_documents_with_window_and_fewer_queries():
    torch.manual_seed(0)
    ids = packed_document_ids(2, 100, [[60, 40], [10, 90]])
    assert_matches_fp64(*qkv(B=2, Hq=2, Hkv=2, Tq=45, Tk=100, D=16), causal=True, window=(25, 0), document_ids=ids)


def every_third_row_blind(b, h, q_idx, kv_idx):
    # rows q % 3 == 0 see no key at all; the others a per-head striped pattern
    return (q_idx % 3 != 0) & ((q_idx // 7 + kv_idx // 5 + h) % 3 == 0)


def test_mask_fn_matches_fp64_including_rows_that_see_nothing():
    torch.manual_seed(0)
    block_mask = BlockMask.from_mask_fn(every_third_row_blind, 1, 2, 90, 90)
    assert block_mask.state.shape == (1, 2, 3, 3) and block_mask.tile_bits is not None
    q, k, v = qkv(B=2, Hq=2, Hkv=1, Tq=90, Tk=90, D=16)
    assert_matches_fp64(q, k, v, causal=False, block_mask=block_mask)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, causal=False, backend="triton", block_mask=block_mask)
    assert out[:, :, ::3].abs().max() == 0  # rows that see nothing: output 0
    out.sum().backward()
    assert all(t.grad.isfinite().all() for t in (q, k, v))
    assert q.grad[:, :, ::3].abs().max() == 0  # and no gradient


def test_mask_fn_with_causal_combines_both():
    torch.manual_seed(0)
    block_mask = BlockMask.from_mask_fn(lambda b, h, q_idx, kv_idx: (kv_idx // 16) % 2 == 0, 1, 1, 75, 75)
    assert_matches_fp64(*qkv(B=1, Hq=2, Hkv=2, Tq=75, Tk=75, D=32, dtype=torch.float16),
                        causal=True, block_mask=block_mask)


def test_block_layout_matches_fp64_with_ragged_blocks():
    torch.manual_seed(0)
    layout = torch.tensor([[True, False, True], [False, True, False], [True, True, False]])  # 3 x 3 blocks of 32
    block_mask = BlockMask.from_layout(layout, 90, 70)  # T not a multiple of the block
    assert_matches_fp64(*qkv(B=2, Hq=2, Hkv=2, Tq=90, Tk=70, D=16), causal=False, block_mask=block_mask)


def test_block_mask_is_reused_across_calls():
    block_mask = BlockMask.from_mask_fn(lambda b, h, q_idx, kv_idx: kv_idx % 2 == 0, 1, 1, 64, 64)
    q, k, v = qkv(Tq=64, Tk=64, D=16)
    first = attention(q, k, v, backend="triton", block_mask=block_mask)
    lists = block_mask.restrict(causal=True).kv_blocks()
    second = attention(q, k, v, backend="triton", block_mask=block_mask)
    assert block_mask.restrict(causal=True).kv_blocks() is lists  # built once, then cached
    assert torch.equal(first, second)


def test_block_states_are_exact_for_the_built_in_rules():
    # FULL <=> every element of the block visible, SKIP <=> none (PARTIAL otherwise), per rule
    ids = packed_document_ids(2, 150, [[40, 33, 77], [100, 50]])
    for kwargs in [dict(causal=True), dict(causal=True, window=(50, 0)), dict(window=(20, 40)),
                   dict(causal=True, document_ids=ids), dict(window=(64, 0), document_ids=ids)]:
        for Tq in (150, 61):
            mask = BlockMask.from_rules(Tq, 150, **kwargs)
            dense = dense_mask(Tq, 150, batch=2, **{"causal": False, **kwargs})
            bs = mask.block_size
            padded = torch.zeros(dense.shape[0], 1, mask.state.shape[2] * bs, mask.state.shape[3] * bs, dtype=torch.bool)
            padded[..., :Tq, :150] = dense
            per_block = padded.unflatten(2, (-1, bs)).unflatten(4, (-1, bs)).sum((3, 5))
            expected = torch.where(per_block == bs * bs, FULL, torch.where(per_block == 0, SKIP, PARTIAL))
            assert torch.equal(mask.state.expand_as(expected), expected.to(torch.int8)), kwargs


def test_sparse_call_errors_name_the_fix():
    q, k, v = qkv(Tq=64, Tk=64, D=16)
    with pytest.raises(ValueError, match="window must be two ints"):
        attention(q, k, v, backend="triton", window=(10,))
    with pytest.raises(ValueError, match="built for Tq=32"):
        attention(q, k, v, backend="triton", block_mask=BlockMask.from_layout(torch.ones(1, 1, dtype=torch.bool), 32, 32))
    with pytest.raises(TypeError, match="attention.BlockMask"):
        attention(q, k, v, backend="triton", block_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="layout must be a bool tensor"):
        BlockMask.from_layout(torch.ones(3, 3, dtype=torch.bool), 64, 64)
    with pytest.raises(ValueError, match="power of two"):
        BlockMask.from_rules(64, 64, causal=True, block_size=48)
    with pytest.raises(ValueError, match="document_ids"):
        attention(q, k, v, backend="triton", document_ids=torch.zeros(1, 10, dtype=torch.long))


def test_document_ids_mask_built_once_per_ids_tensor(monkeypatch):
    # a model passes one batch's ids to every layer: the first call builds the block mask, the others reuse it, and
    # ids written in place are a new mask (the result must follow them)
    torch.manual_seed(0)
    q, k, v = qkv(B=2, Hq=2, Hkv=2, Tq=48, Tk=48, D=16)
    ids = packed_document_ids(2, 48, [[10, 38], [5, 5, 40]])
    builds = []
    from_rules = BlockMask.from_rules
    monkeypatch.setattr(BlockMask, "from_rules", lambda *a, **kw: (kw.get("document_ids") is not None
                                                                   and builds.append(1)) or from_rules(*a, **kw))
    first = attention(q, k, v, backend="naive", document_ids=ids)
    for _ in range(3):
        torch.testing.assert_close(attention(q, k, v, backend="naive", document_ids=ids), first, atol=0, rtol=0)
    assert len(builds) == 1
    ids[0, 20:] += 1  # a new document from position 20 in row 0
    changed = attention(q, k, v, backend="naive", document_ids=ids)
    assert len(builds) == 2
    torch.testing.assert_close(changed, attention(q, k, v, backend="naive", document_ids=ids.clone()), atol=0, rtol=0)
    assert not torch.equal(changed[0], first[0])


@pytest.mark.parametrize("Tq,Tk,causal,window,block", [(100, 100, True, None, 16), (70, 100, True, (20, 0), 16),
                                                        (100, 100, False, (10, 5), 32), (33, 33, False, None, 16)])
def test_document_lists_kernel_matches_the_torch_build(monkeypatch, Tq, Tk, causal, window, block):
    # flash/block_lists.py builds a document mask's state and block lists in three launches; they must equal
    # block_mask.py's torch build, for packed ids and for ids that are not sorted (row 1)
    from attention import block_mask

    torch.manual_seed(0)
    ids = torch.sort(torch.randint(0, 5, (3, Tk)), dim=1).values.to(torch.int32)
    ids[1] = torch.randint(0, 3, (Tk,))
    by_kernel = BlockMask.from_rules(Tq, Tk, causal=causal, window=window, document_ids=ids, block_size=block)
    monkeypatch.setattr(block_mask, "lists_by_kernel", lambda device: False)
    by_torch = BlockMask.from_rules(Tq, Tk, causal=causal, window=window, document_ids=ids, block_size=block)
    assert torch.equal(by_kernel.state, by_torch.state)
    assert torch.equal(by_kernel.kv_blocks(), by_torch.kv_blocks())
    assert torch.equal(by_kernel.q_blocks(), by_torch.q_blocks())
