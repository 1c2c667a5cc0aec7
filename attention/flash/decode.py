"""Flash-decoding in Triton: one new query per sequence against a preallocated KV cache.

Decoding (split-K)
------------------
A decode step has Tq = 1. The forward kernel of flash/tl_forward.py would give each (batch, head) one
program holding a BLOCK_M-row query tile with a single real row: B*Hq programs (12 for GPT-2 at
B=1) on a GPU with 132 SMs, each walking the whole cache alone. Decoding is a read of the cache,
so its speed is memory bandwidth, and a few SMs cannot draw much of it. So we split the *keys*:

  1. _decode_split, grid (num_splits, B*Hkv). Program (s, b*Hkv + j) reads keys
     [s*L, min((s+1)*L, cache_len[b])) of kv head j, L = keys_per_split, and runs the online softmax
     (docs/flash_attention.md §2) over them for every query head of the group at once: the GROUP
     = Hq/Hkv queries that share kv head j are the rows of the tl.dot, padded to 16 (the least
     tl.dot takes), so a kv head's keys are read once per group, not once per query head. It
     writes a partial output o_s = a_s / l_s and its log-sum-exp lse_s = m_s + log l_s.
  2. _decode_merge, grid (B*Hq,), combines the splits of one query head. A split's softmax was
     normalised over its own keys only; weighting it by w_s = exp(lse_s - M) / sum_t exp(lse_t - M),
     M = max_t lse_t, renormalises over all keys, because exp(lse_s) is that split's share of the
     full softmax denominator:
         o = sum_s exp(lse_s) o_s / sum_s exp(lse_s)       (subtracting M keeps exp <= 1).
     A split that saw no key has lse_s = -inf and weight 0.

Everything runs in base 2 (exp2, log2; §8), with scores pre-multiplied by scale * log2(e).

cache_len is read on the device, never on the host: the grid and keys_per_split depend only on
the buffer's max_len, so one launch configuration serves every step, which is what lets
GPT.generate capture the step in a CUDA graph. Splits past cache_len find an empty key range and
only write lse = -inf; the ragged end of the last non-empty split is masked.
"""
import torch
import triton
import triton.language as tl

from .tl_tiles import LOG2E, head_base, load_rows
from .device import INTERPRET, sm_count
from .tiles import SMEM_BUDGET, smem_bytes

# Launch shape on the GPU. One query row per head makes the program short on math: 4 warps are
# plenty, and 2 stages keep the next K/V tile's load in flight. Key tiles: the largest of these
# whose buffers leave room for PROGRAMS_PER_SM programs in shared memory (see _block_n).
BLOCK_N_CHOICES, NUM_WARPS, NUM_STAGES = (64, 32, 16), 4, 2
INTERPRETER_BLOCK_N = 16  # small tiles so the CPU tests cover several tiles and splits cheaply
MIN_ROWS = 16  # tl.dot's least M: the group's query rows (and the merge's splits) are padded up to it
PROGRAMS_PER_SM = 2  # two resident programs per SM: one's loads overlap the other's math
MIN_TILES_PER_SPLIT = 2  # below this, writing and merging a partial costs about what the split saves
# Under the interpreter there are no SMs; a small stand-in makes the CPU tests split their caches.
INTERPRETER_SMS = 4


def _block_n(block_g: int, block_d: int, elem_bytes: int) -> int:
    if INTERPRET:
        return INTERPRETER_BLOCK_N
    # the program holds the query rows and streams K and V tiles, as the forward kernel does
    fits = [n for n in BLOCK_N_CHOICES
            if smem_bytes("fwd", (block_g, n, NUM_WARPS, NUM_STAGES), block_d, elem_bytes) * PROGRAMS_PER_SM
            <= SMEM_BUDGET]
    return fits[0] if fits else BLOCK_N_CHOICES[-1]


def _num_sms(device: torch.device) -> int:
    return sm_count(device) if device.type == "cuda" else INTERPRETER_SMS


def split_plan(max_len: int, programs: int, num_sms: int, block_n: int) -> tuple[int, int]:
    """-> (num_splits, keys_per_split) for a cache of max_len keys and `programs` = B*Hkv key streams.

    Enough splits to put PROGRAMS_PER_SM programs on every SM (at B*Hkv >= that, one split: the
    batch alone fills the GPU), but at least MIN_TILES_PER_SPLIT key tiles per split. Decided from
    max_len, not from the cache's current length: a static grid for every step of a CUDA graph."""
    tiles = triton.cdiv(max_len, block_n)
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, programs)
    num_splits = max(1, min(wanted, tiles // MIN_TILES_PER_SPLIT))
    tiles_per_split = triton.cdiv(tiles, num_splits)
    # rounding tiles_per_split up can leave the last splits without keys of the buffer: drop them
    return triton.cdiv(tiles, tiles_per_split), tiles_per_split * block_n


@triton.jit
def _decode_split(Q, K, V, CACHE_LEN, O_PART, LSE_PART,
                  stride_qb, stride_qh, stride_qd,
                  stride_kb, stride_kh, stride_kt, stride_kd,
                  stride_vb, stride_vh, stride_vt, stride_vd,
                  stride_len, Hkv, GROUP, max_len, keys_per_split, num_splits, scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    split = tl.program_id(0)
    bh_kv = tl.program_id(1)
    b, h_kv = bh_kv // Hkv, bh_kv % Hkv
    # cache_len counts the valid keys, the new token's included; capped at the buffer so that a
    # too-large value cannot read past it. stride_len is 0 when one length serves every row.
    n_keys = tl.minimum(tl.load(CACHE_LEN + b * stride_len).to(tl.int32), max_len)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, n_keys)  # <= start for a split past the cache's end

    # The group's query heads h_kv*GROUP .. h_kv*GROUP + GROUP-1 as rows: row g is query head
    # h_kv*GROUP + g, one stride_qh further on (q's Tq axis has length 1 and drops out).
    rows = tl.arange(0, BLOCK_G)  # (G,)
    cols = tl.arange(0, BLOCK_D)  # (D,)
    q = load_rows(head_base(Q, b, h_kv * GROUP, stride_qb, stride_qh), rows, GROUP, stride_qh, cols, stride_qd,
                   HEAD_DIM, True)  # (G, D); padding rows read 0 and are never stored
    K = head_base(K, b, h_kv, stride_kb, stride_kh)
    V = head_base(V, b, h_kv, stride_vb, stride_vh)
    qk_scale = scale * LOG2E
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)  # (N,)
        k = load_rows(K, k_pos, end, stride_kt, cols, stride_kd, HEAD_DIM, True)  # (N, D); rows >= end read 0
        v = load_rows(V, k_pos, end, stride_vt, cols, stride_vd, HEAD_DIM, True)  # (N, D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (G, N), fp32 sums
        s = tl.where(k_pos[None, :] < end, qk * qk_scale, float("-inf"))  # base-2 scores; keys past end masked
        # §2 online softmax. Every tile in [start, end) holds at least one key below end, so m_new
        # is finite and, unlike the forward kernel's masked tiles, needs no -inf guard.
        m_new = tl.maximum(m_i, tl.max(s, 1))  # (G,)
        p = tl.exp2(s - m_new[:, None])  # (G, N)
        alpha = tl.exp2(m_i - m_new)  # (G,); 0 on the first tile, where m_i = -inf
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # (G, D)
        m_i = m_new

    # partial results, fp32, row (b*Hq + query head) * num_splits + split. A split without keys
    # has l = 0: it writes o = 0 and lse = -inf, which gives it weight 0 in the merge.
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    part_rows = ((b * Hkv + h_kv) * GROUP + rows).to(tl.int64) * num_splits + split  # (G,)
    tl.store(LSE_PART + part_rows, tl.where(seen, m_i + tl.log2(l_safe), float("-inf")), mask=rows < GROUP)
    tl.store(O_PART + part_rows[:, None] * HEAD_DIM + cols[None, :], acc / l_safe[:, None],
             mask=(rows[:, None] < GROUP) & (cols[None, :] < HEAD_DIM))


@triton.jit
def _decode_merge(O_PART, LSE_PART, O, stride_ob, stride_oh, stride_od, Hq, num_splits,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    bh = tl.program_id(0)
    b, h = bh // Hq, bh % Hq
    splits = tl.arange(0, BLOCK_S)  # (S,)
    cols = tl.arange(0, BLOCK_D)  # (D,)
    part_rows = bh.to(tl.int64) * num_splits + splits  # (S,)
    lse = tl.load(LSE_PART + part_rows, mask=splits < num_splits, other=float("-inf"))  # (S,), base 2
    o_part = tl.load(O_PART + part_rows[:, None] * HEAD_DIM + cols[None, :],
                     mask=(splits[:, None] < num_splits) & (cols[None, :] < HEAD_DIM), other=0.0)  # (S, D)
    # renormalise each split's softmax over all keys (module docstring). A head that saw no key at
    # all (cache_len 0) has every lse = -inf: subtract 0 instead of M and the output comes out 0
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # (S,)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o_part, 0) / tl.where(total > 0, total, 1.0)  # (D,)
    O = head_base(O, b, h, stride_ob, stride_oh)
    tl.store(O + cols * stride_od, out.to(O.dtype.element_ty), mask=cols < HEAD_DIM)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: torch.Tensor,
           scale: float) -> torch.Tensor:
    """q (B, Hq, 1, D), k_cache/v_cache (B, Hkv, max_len, D), any strides; cache_len int (B,), or
    () or (1,) for all rows, on q's device. -> (B, Hq, 1, D) in q's dtype.
    Inputs are checked by attention.decode.decode_attention, the public entry point."""
    B, Hq, _, D = q.shape
    Hkv, max_len = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    block_g, block_d = max(MIN_ROWS, triton.next_power_of_2(group)), triton.next_power_of_2(D)
    block_n = _block_n(block_g, block_d, q.element_size())
    num_splits, keys_per_split = split_plan(max_len, B * Hkv, _num_sms(q.device), block_n)
    o_part = torch.empty(B * Hq, num_splits, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B * Hq, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    _decode_split[(num_splits, B * Hkv)](
        q, k_cache, v_cache, cache_len, o_part, lse_part,
        q.stride(0), q.stride(1), q.stride(3), *k_cache.stride(), *v_cache.stride(),
        0 if cache_len.numel() == 1 else cache_len.stride(0),  # one length shared by every row
        Hkv, group, max_len, keys_per_split, num_splits, scale,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_G=block_g, BLOCK_N=block_n,
        # as in dispatch: exact fp32 products for fp32 inputs (§8)
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    _decode_merge[(B * Hq,)](o_part, lse_part, out, out.stride(0), out.stride(1), out.stride(3), Hq, num_splits,
                             # padded like the query rows: no 1-element tensors when there is one split
                             HEAD_DIM=D, BLOCK_D=block_d, BLOCK_S=max(MIN_ROWS, triton.next_power_of_2(num_splits)))
    return out
