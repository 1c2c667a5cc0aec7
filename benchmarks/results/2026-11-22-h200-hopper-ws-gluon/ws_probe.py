"""Probe: the forward with Triton's Hopper warp specialization (a TMA producer warpgroup and two
consumer warpgroups of 64 rows each), host-side tensor descriptors, num_warps=4."""
import sys, json, os
import torch, triton, triton.language as tl
from attention.triton_flash import _key_ranges, _causal_visible, _query_tile_start, LOG2E, LN2


@triton.jit
def _ws_tile(acc, m_i, l_i, q, desc_k, desc_v, b, h_kv, start_n, qk_scale, visible,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    k = desc_k.load([b, h_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    qk = tl.dot(q, tl.trans(k))
    if visible is not None:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_ref = m_new
    if visible is not None:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk * qk_scale - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = desc_v.load([b, h_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _ws_fwd(desc_q, desc_k, desc_v, O, LSE, stride_ob, stride_oh, stride_ot, H, GROUP, Tq, Tk, scale,
            HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            MASKED: tl.constexpr, WS: tl.constexpr):
    start_m = _query_tile_start(BLOCK_M, CAUSAL)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    q = desc_q.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    q_pos = start_m + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = scale * LOG2E
    _, end = _key_ranges(start_m, Tq, Tk, BLOCK_M, BLOCK_N, CAUSAL)
    # one loop: Triton 3.6's Hopper warp specialization fails on a kernel with two loops, so the
    # mask, where the call needs one, is applied to every tile
    for start_n in tl.range(0, end, BLOCK_N, warp_specialize=WS):
        visible = None
        if MASKED:
            visible = _causal_visible(q_pos[:, None], (start_n + tl.arange(0, BLOCK_N))[None, :], Tq, Tk, CAUSAL)
        acc, m_i, l_i = _ws_tile(acc, m_i, l_i, q, desc_k, desc_v, b, h // GROUP, start_n, qk_scale, visible,
                                 HEAD_DIM, BLOCK_N)
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("inf"))
    cols = tl.arange(0, HEAD_DIM)
    o_ptrs = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + q_pos[:, None] * stride_ot + cols[None, :]
    tl.store(o_ptrs, (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=q_pos[:, None] < Tq)
    tl.store(LSE + bh.to(tl.int64) * Tq + q_pos, lse, mask=q_pos < Tq)


def ws_forward(q, k, v, causal, tile, ws=True):
    from triton.tools.tensor_descriptor import TensorDescriptor
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    bm, bn, w, s = tile
    o = torch.empty(B, Tq, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    desc = lambda t, rows: TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, D])
    _ws_fwd[(triton.cdiv(Tq, bm), B * H)](desc(q, bm), desc(k, bn), desc(v, bn), o, lse, o.stride(0), o.stride(1),
                                          o.stride(2), H, H // Hkv, Tq, Tk, D ** -0.5, HEAD_DIM=D, CAUSAL=causal,
                                          BLOCK_M=bm, BLOCK_N=bn, MASKED=causal or Tk % bn != 0, WS=ws, num_warps=w, num_stages=s)
    return o, lse


TILES = {128: [(128, 128, 4, 2), (128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 4, 4)],
         64: [(128, 128, 4, 2), (128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 3), (256, 64, 4, 3)]}

if __name__ == "__main__":
    # one (head dim, causal) pair per process: a hung kernel only loses its own pair (run under timeout)
    from torch.nn.attention import sdpa_kernel, SDPBackend
    import torch.nn.functional as F
    from attention import triton_flash as tf
    D, causal = int(sys.argv[1]), sys.argv[2] == "1"
    log = open(os.path.join(os.environ.get("OUT", "."), f"ws_probe_{D}_{int(causal)}.jsonl"), "a")
    for T in (1024, 4096, 16384):
        B, H = 16384 // T, 2048 // D
        q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal).float()
        runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                "ours": lambda: tf.forward(q, k, v, causal, D ** -0.5)[0]}
        runs.update({f"ws{tile}": (lambda tile=tile: ws_forward(q, k, v, causal, tile)[0]) for tile in TILES[D]})
        for name, f in runs.items():
            print(f"D={D} causal={causal:d} T={T} {name} ...", end=" ", flush=True)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                try:
                    err = (f().float() - ref).abs().max().item()
                    ms = triton.testing.do_bench(f, warmup=25, rep=200)
                except Exception as e:
                    err, ms = repr(e)[:120], None
            print(ms, err, flush=True)
            log.write(json.dumps(dict(D=D, causal=causal, T=T, name=name, ms=ms, err=err)) + "\n"); log.flush()
