"""The Triton FlashAttention kernel compiled for a CUDA GPU, at training sizes, in bfloat16 and
float16 (which the CPU interpreter cannot check). Skipped without a GPU (see conftest.py).

Benchmarking every tile config for every new shape would take minutes, so these tests take each
kernel's default config (NANOFLASH_AUTOTUNE=0); test_autotuned_choice_is_correct runs the tuner."""
import pytest
import torch
from helpers import (assert_bitwise_deterministic, assert_compiled_matches_eager, assert_matches_fp64,
                     assert_qkvpacked_matches_fp64, packed_qkv, projection_views, qkv)

from attention.flash import dispatch
from attention.flash import tuner
from attention.flash import tiles

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("default_tiles")]  # conftest.py


@pytest.mark.parametrize(
    "dtype, D, causal, B, Hq, Hkv, Tq, Tk",
    [
        (torch.bfloat16, 64, True, 4, 4, 4, 1024, 1024),  # GPT-2 small's head
        (torch.float16, 64, False, 2, 4, 4, 1000, 1000),  # ragged last tile
        (torch.bfloat16, 128, True, 2, 8, 2, 2048, 2048),  # GQA
        (torch.float16, 128, False, 1, 4, 1, 777, 777),  # MQA, ragged
        (torch.bfloat16, 80, True, 2, 4, 4, 1000, 1000),  # head dim padded to 128 in the kernel
        (torch.float16, 160, False, 1, 4, 4, 513, 513),  # head dim padded to 256
        (torch.bfloat16, 256, True, 1, 4, 4, 1024, 1024),
        (torch.float16, 64, True, 2, 4, 2, 300, 1000),  # Tq < Tk
        (torch.bfloat16, 64, True, 2, 4, 2, 1000, 300),  # Tq > Tk: 700 rows see no key
        (torch.float32, 64, True, 1, 4, 4, 512, 512),  # exact fp32 dots ("ieee")
        (torch.bfloat16, 128, True, 1, 2, 1, 16384, 16384),  # long context
        (torch.float16, 64, False, 1, 2, 2, 8200, 8200),  # long and ragged
        (torch.bfloat16, 36, True, 2, 4, 4, 700, 700),  # 72-byte rows: no tensor descriptors, pointer loads
    ],
)
def test_matches_fp64(dtype, D, causal, B, Hq, Hkv, Tq, Tk):
    torch.manual_seed(0)
    assert_matches_fp64(*qkv(B, Hq, Hkv, Tq, Tk, D, dtype, device="cuda"), causal=causal)


def test_fused_qkv_views():
    torch.manual_seed(0)
    q, k, v = projection_views(2, 1024, 12, 64, torch.bfloat16, "cuda")
    assert_matches_fp64(q, k, v, causal=True)


@pytest.mark.parametrize("T, window", [(1024, None), (999, (256, 0))])
def test_qkvpacked_matches_fp64(T, window):
    torch.manual_seed(0)
    assert_qkvpacked_matches_fp64(packed_qkv(2, T, 12, 64, torch.bfloat16, "cuda"), window=window)


def test_kept_launches_follow_alignment():
    # attention/flash/launch.py keeps a compiled kernel per launch key: the same shapes and strides at an address off
    # 16-byte alignment must get a kernel compiled for it (a kept aligned one would issue misaligned vector loads)
    torch.manual_seed(0)
    aligned = qkv(2, 4, 4, 1000, 1000, 64, torch.bfloat16, device="cuda")
    shifted = [torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")[1:].view_as(t).copy_(t) for t in aligned]
    assert all(t.data_ptr() % 16 == 2 for t in shifted)
    for q, k, v in (aligned, shifted, aligned):
        assert_matches_fp64(q, k, v, causal=True)


@pytest.mark.parametrize("tma_mode", ["1", "0"])  # the forward's descriptor loads (Hopper), pointer loads
def test_load_paths_match_fp64(monkeypatch, tma_mode):
    monkeypatch.setattr(dispatch, "TMA_MODE", tma_mode)
    torch.manual_seed(0)
    assert_matches_fp64(*qkv(2, 8, 4, 1000, 1000, 128, torch.bfloat16, device="cuda"), causal=True)


def test_backward_is_bitwise_deterministic():
    torch.manual_seed(0)
    assert_bitwise_deterministic(*qkv(2, 8, 2, 4096, 4096, 128, torch.bfloat16, device="cuda"))


@pytest.mark.parametrize("packed", [False, True], ids=["views", "packed"])
def test_torch_compile_fullgraph(packed):
    torch.manual_seed(0)
    assert_compiled_matches_eager(2, 512, 4, 64, torch.bfloat16, "cuda", tol=2e-2, packed=packed)


@pytest.mark.parametrize("kernel, head_dim, tile", [(kernel, head_dim, tile)
                                                     for kernel, by_dim in tiles.TL_TILES.items()
                                                     for head_dim in (64, 128) for tile in by_dim[head_dim]])
def test_every_tile_candidate_matches_fp64(monkeypatch, kernel, head_dim, tile):
    # the tuner may pick any candidate for some shape: each one alone, on a causal, ragged call
    monkeypatch.setitem(tiles.TL_TILES, kernel, {**tiles.TL_TILES[kernel], head_dim: [tile]})
    monkeypatch.setattr(tuner, "best_tile", {})
    torch.manual_seed(0)
    assert_matches_fp64(*qkv(2, 4, 2, 1000, 1000, head_dim, torch.bfloat16, device="cuda"), causal=True)


def test_autotuned_choice_is_correct(monkeypatch):
    # a shape no other test uses, so its tuning key is new and the tuner really benchmarks
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "1")
    torch.manual_seed(0)
    assert_matches_fp64(*qkv(2, 6, 6, 1536, 1536, 64, torch.float16, device="cuda"), causal=True)
