"""The fused MoBA kernels (attention/triton_moba.py) against float64, forward and backward, on the CPU
interpreter (small blocks) and, marked gpu, at training sizes in bf16."""
import pytest
import torch
from test_triton import out_and_grads

from attention.moba import moba_attention, moba_mask, moba_select
from attention.naive import naive_attention
from attention.triton_moba import entry_lists, moba_gate, moba_triton, work_items


def assert_moba_matches_fp64(B, Hq, Hkv, T, D, block_size, topk, dtype, device="cpu"):
    """err(triton) <= 2 * err(dense reference in the same dtype) + 1e-5 for out, dq, dk, dv, the
    selection made once (on the float64 inputs) so every run attends to the same blocks."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, dtype=dtype, device=device) for H in (Hq, Hkv, Hkv, Hq))
    selection = moba_select(q.double(), k.double(), block_size, topk)
    visible = moba_mask(selection, block_size, T)
    scale = D ** -0.5

    def reference(*t):
        return naive_attention(*t, causal=True, scale=scale, visible=visible)

    exact = out_and_grads(reference, q.double(), k.double(), v.double(), do.double())
    math = out_and_grads(reference, q, k, v, do)
    ours = out_and_grads(lambda *t: moba_triton(*t, selection, block_size, scale), q, k, v, do)
    for name, ref, theirs, mine in zip(("out", "dq", "dk", "dv"), exact, math, ours):
        err_math = (theirs.double() - ref).abs().max().item()
        err_ours = (mine.double() - ref).abs().max().item()
        assert err_ours <= 2 * err_math + 1e-5, f"{name}: error {err_ours:.3g} vs the reference's {err_math:.3g}"


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
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 90, 16), torch.randn(2, 3, 90, 16)
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


@pytest.mark.gpu
@pytest.mark.parametrize(
    "B, Hq, Hkv, T, D, block_size, topk, dtype",
    [
        (1, 4, 2, 4096, 64, 512, 3, torch.bfloat16),
        (2, 4, 4, 3000, 128, 256, 2, torch.float16),  # ragged last block
        (1, 2, 1, 8192, 128, 512, 3, torch.bfloat16),
    ],
)
def test_moba_matches_fp64_gpu(B, Hq, Hkv, T, D, block_size, topk, dtype):
    assert_moba_matches_fp64(B, Hq, Hkv, T, D, block_size, topk, dtype, device="cuda")


@pytest.mark.gpu
def test_moba_compiled_matches_eager():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2048, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))

    def step(q, k, v):
        return moba_attention(q, k, v, block_size=512, topk=2).float().square().sum()

    eager = torch.autograd.grad(step(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("Hkv, T, topk", [(2, 100, 2), (4, 64, 5), (1, 130, 1)])
def test_fused_gate_selects_like_moba_select(Hkv, T, topk):
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, T, 16), torch.randn(2, Hkv, T, 16)
    assert torch.equal(moba_gate(q, k, 16, topk), moba_select(q, k, 16, topk))


@pytest.mark.gpu
def test_fused_gate_selects_like_moba_select_gpu():
    # bf16 inputs, scores in fp32 summed in a different order than cuBLAS's: near-ties may flip
    torch.manual_seed(0)
    q, k = (torch.randn(1, 8, 8192, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    same = moba_gate(q, k, 512, 3) == moba_select(q, k, 512, 3)
    assert same.float().mean() > 0.999
