"""decode_attention: one query per sequence against a KV-cache buffer with per-row valid lengths."""
import pytest
import torch
from helpers import projection_views, qkv

from attention import decode_attention
from attention.flash import decode as flash_decode
from attention.flash.decode import split_plan
from attention.flash import tiles

BACKENDS = ["naive", "sdpa", "triton"]
# (B, Hq, Hkv, max_len, D, cache_len). In the interpreter (16-key tiles, 4 stand-in SMs) the first
# two split their buffers: 2 splits of 48 keys, then 3 of 48, so the 5-key row and the 77-key row
# leave a split with no key. The third has one split and cache lengths down to 1.
CASES = [
    (2, 4, 1, 70, 16, [70, 5]),  # GQA, a group of 4 query heads per kv head
    (1, 3, 1, 100, 64, [77]),  # odd max_len, the last split empty
    (3, 2, 2, 9, 16, [9, 1, 4]),  # one head per group, cache_len == 1
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def reference(q, k_cache, v_cache, lengths, scale=None):
    """float64 softmax attention of each row's query over its first lengths[b] keys."""
    B, Hq, _, D = q.shape
    group = Hq // k_cache.shape[1]
    out = torch.zeros(B, Hq, 1, D, dtype=torch.float64)
    for b, n in enumerate(lengths):
        k = k_cache[b, :, :n].double().cpu().repeat_interleave(group, dim=0)  # (Hq, n, D)
        v = v_cache[b, :, :n].double().cpu().repeat_interleave(group, dim=0)
        scores = q[b].double().cpu() @ k.transpose(-2, -1) * (scale or D**-0.5)  # (Hq, 1, n)
        out[b] = torch.softmax(scores, dim=-1) @ v
    return out


def make_inputs(B, Hq, Hkv, max_len, D, dtype, device="cpu", seed=0):
    """q as the model makes it, a (B, Hq, 1, D) strided view into a (B, 1, 3C) qkv projection, and fresh random
    (B, Hkv, max_len, D) key and value buffers, every position of them written."""
    q = projection_views(B, 1, Hq, D, dtype, device, seed=seed)[0]
    _, k_cache, v_cache = qkv(B, Hq, Hkv, 1, max_len, D, dtype, device, seed=seed + 1)
    return q, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-L{c[3]}-D{c[4]}")
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_float64_reference(backend, case, dtype):
    B, Hq, Hkv, max_len, D, lengths = case
    q, k_cache, v_cache = make_inputs(B, Hq, Hkv, max_len, D, dtype)
    out = decode_attention(q, k_cache, v_cache, torch.tensor(lengths), backend=backend)
    assert out.shape == (B, Hq, 1, D) and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, lengths), rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_keys_past_cache_len_are_ignored_and_one_length_serves_all_rows(backend):
    q, k_cache, v_cache = make_inputs(2, 2, 1, 40, 16, torch.float32)
    shared = decode_attention(q, k_cache, v_cache, torch.tensor(23, dtype=torch.int32), scale=0.3, backend=backend)
    # garbage past the valid keys changes nothing (naive and sdpa weight its values by exactly 0, so
    # they need it finite, as KVCache's zero-filled buffer is; the Triton kernel never loads it)
    k_cache[:, :, 23:], v_cache[:, :, 23:] = 1e4, float("nan") if backend == "triton" else -1e4
    for cache_len in (torch.tensor([23]), torch.tensor([23, 23])):
        torch.testing.assert_close(decode_attention(q, k_cache, v_cache, cache_len, scale=0.3, backend=backend), shared)
    torch.testing.assert_close(shared.double(), reference(q, k_cache, v_cache, [23, 23], scale=0.3),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_lengths_past_the_buffer_count_as_max_len_and_zero_gives_zeros(backend):
    q, k_cache, v_cache = make_inputs(2, 2, 2, 20, 16, torch.float32)
    out = decode_attention(q, k_cache, v_cache, torch.tensor([1000, 0]), backend=backend)
    torch.testing.assert_close(out[:1].double(), reference(q, k_cache, v_cache, [20])[:1], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # a query that sees no key: 0, as attention() defines it


def test_split_plan_fills_the_gpu_without_empty_or_tiny_splits():
    sms, block_n = 132, 64  # an H200
    for max_len in (1, 64, 65, 320, 1000, 1024, 8192):
        for programs in (1, 12, 96, 264, 384):
            num_splits, keys = split_plan(max_len, programs, sms, block_n)
            assert keys % block_n == 0 and num_splits * keys >= max_len  # every key is in a split
            assert (num_splits - 1) * keys < max_len  # and no split lies past the buffer
            assert num_splits == 1 or keys >= 2 * block_n  # a split of one tile costs more than it saves
            if programs >= 2 * sms:
                assert num_splits == 1  # the batch alone fills the GPU
    # GPT-2 at B=1 (12 kv heads) on a 1024-key buffer: 8 splits of 128 keys, 96 programs
    assert split_plan(1024, 12, sms, block_n) == (8, 128)
    assert split_plan(1024, 96, sms, block_n) == (3, 384)


def test_gpu_key_tiles_shrink_with_the_head_dim_to_fit_two_programs_per_sm(monkeypatch):
    monkeypatch.setattr(flash_decode, "INTERPRET", False)  # the GPU choice, computed on the host
    chosen = {(d, size): flash_decode._block_n(16, d, size) for d in (64, 128, 256) for size in (2, 4)}
    assert chosen[64, 2] == 64 and chosen[256, 4] < chosen[128, 4] < chosen[128, 2] == 64  # GPT-2's: 64 keys
    for (d, size), block_n in chosen.items():
        tile = (16, block_n, flash_decode.NUM_WARPS, flash_decode.NUM_STAGES)
        assert 2 * tiles.smem_bytes("fwd", tile, d, size) <= tiles.SMEM_BUDGET


def test_bad_inputs_raise_clear_errors():
    q, k_cache, v_cache = make_inputs(2, 2, 1, 8, 16, torch.float32)
    n = torch.tensor([3, 4])
    with pytest.raises(ValueError, match="one new query per sequence.*Tq=2.*attention"):
        decode_attention(torch.cat((q, q), dim=2), k_cache, v_cache, n)
    with pytest.raises(TypeError, match="cache_len must be an integer tensor.*got int"):
        decode_attention(q, k_cache, v_cache, 3)
    with pytest.raises(TypeError, match="int32 or int64, got torch.float32"):
        decode_attention(q, k_cache, v_cache, n.float())
    with pytest.raises(ValueError, match=r"shape \(2,\).*got \(3,\)"):
        decode_attention(q, k_cache, v_cache, torch.tensor([3, 4, 5]))
    with pytest.raises(ValueError, match="cache_len is on meta"):
        decode_attention(q, k_cache, v_cache, n.to("meta"))
    with pytest.raises(ValueError, match=r"k has seq_len 0 \(shape \(2, 1, 0, 16\)\)"):  # an empty cache buffer
        decode_attention(q, k_cache[:, :, :0], v_cache[:, :, :0], n)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):  # check_qkv's checks apply
        decode_attention(q, k_cache.expand(2, 3, 8, 16), v_cache.expand(2, 3, 8, 16), n)
    with pytest.raises(ValueError, match="unknown attention backend 'flash9000'; choose one of"):
        decode_attention(q, k_cache, v_cache, n, backend="flash9000")
    with pytest.raises(TypeError, match="the triton attention kernels support float16, bfloat16 and float32"):
        decode_attention(q.double(), k_cache.double(), v_cache.double(), n, backend="triton")
    with pytest.raises(ValueError, match="the triton attention kernels support head_dim 16..256, got 8"):
        decode_attention(q[..., :8], k_cache[..., :8], v_cache[..., :8], n, backend="triton")


def test_a_backend_without_a_kv_cache_step_is_refused():
    # MoBA picks blocks for a whole sequence at once (attention.Backend.kv_cache False): no one-query form
    q, k_cache, v_cache = make_inputs(2, 2, 1, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="backend 'moba' attends whole sequences only and has no KV-cache decode "
                                         "step; decode with a dense backend"):
        decode_attention(q, k_cache, v_cache, torch.tensor([3, 4]), backend="moba")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 12, 12, 1024, 64), (8, 12, 12, 300, 64), (4, 32, 8, 2000, 128),
                                   (2, 4, 1, 129, 256)], ids=str)
def test_gpu_triton_matches_reference(shape, dtype):
    B, Hq, Hkv, max_len, D = shape
    q, k_cache, v_cache = make_inputs(B, Hq, Hkv, max_len, D, dtype, device="cuda")
    lengths = [max_len - 37 * b for b in range(B)]
    out = decode_attention(q, k_cache, v_cache, torch.tensor(lengths, device="cuda"), backend="triton")
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), reference(q, k_cache, v_cache, lengths), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_decode_step_replays_in_a_cuda_graph_with_new_lengths(backend):
    # the length lives on the device: a graph captured at one length computes the next ones too
    q, k_cache, v_cache = make_inputs(2, 8, 2, 512, 64, torch.bfloat16, device="cuda")
    cache_len = torch.tensor([5, 300], device="cuda")
    decode_attention(q, k_cache, v_cache, cache_len, backend=backend)  # warm-up: compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k_cache, v_cache, cache_len, backend=backend)
    for lengths in ([5, 300], [6, 301], [512, 1]):
        cache_len.copy_(torch.tensor(lengths))
        graph.replay()
        torch.testing.assert_close(out.double().cpu(), reference(q, k_cache, v_cache, lengths), rtol=2e-2, atol=2e-2)
