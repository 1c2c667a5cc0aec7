"""Block-sparse attention (§10) compiled for the GPU, in bfloat16/float16 at training sizes (the
CPU interpreter cannot do bf16). Skipped without a GPU (see conftest.py)."""
import pytest
import torch
from helpers import assert_matches_fp64, packed_document_ids, qkv

from attention import BlockMask, attention

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("default_tiles")]  # conftest.py


@pytest.mark.parametrize(
    "dtype, D, window, causal, T",
    [
        (torch.bfloat16, 64, (1024, 0), True, 4096),
        (torch.float16, 128, (256, 0), True, 3000),  # ragged last block
        (torch.bfloat16, 64, (100, 200), False, 2000),  # both sides, not block multiples
    ],
)
def test_sliding_window(dtype, D, window, causal, T):
    torch.manual_seed(0)
    assert_matches_fp64(*qkv(B=2, Hq=4, Hkv=2, Tq=T, Tk=T, D=D, dtype=dtype, device="cuda"),
                        causal=causal, window=window)


@pytest.mark.parametrize("dtype, D", [(torch.bfloat16, 64), (torch.float16, 128)])
def test_documents(dtype, D):
    torch.manual_seed(0)
    ids = packed_document_ids(2, 3000, [[700, 1, 1299, 1000], [129, 2000, 871]]).cuda()
    assert_matches_fp64(*qkv(B=2, Hq=4, Hkv=4, Tq=3000, Tk=3000, D=D, dtype=dtype, device="cuda"),
                        causal=True, document_ids=ids)


@pytest.mark.parametrize("block_size", [None, 128])  # the default (64), and blocks the kernel walks in tiles
def test_mask_fn_per_head_with_blind_rows(block_size):
    torch.manual_seed(0)

    def striped(b, h, q_idx, kv_idx):
        return (q_idx % 5 != 0) & ((q_idx // 100 + kv_idx // 50 + h) % 3 == 0)

    block_mask = BlockMask.from_mask_fn(striped, 1, 4, 1500, 1500, block_size=block_size, device="cuda")
    assert_matches_fp64(*qkv(B=2, Hq=4, Hkv=1, Tq=1500, Tk=1500, D=64, dtype=torch.bfloat16, device="cuda"),
                        causal=True, block_mask=block_mask)


def test_compiled_window_matches_eager():
    torch.manual_seed(0)
    q, k, v = (t.requires_grad_() for t in qkv(B=2, Hq=4, Hkv=4, Tq=2048, Tk=2048, D=64, dtype=torch.bfloat16,
                                                device="cuda"))

    def step(q, k, v):
        return attention(q, k, v, backend="triton", window=(512, 0)).float().square().sum()

    eager = torch.autograd.grad(step(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
