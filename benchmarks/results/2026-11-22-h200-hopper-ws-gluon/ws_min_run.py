"""Does Triton 3.6's Hopper warp specialization run the simplest attention loop? One call of a single-loop,
descriptor-load forward (no mask), with and without warp_specialize; a hang is caught by the caller's timeout."""
import sys, time, torch, triton, triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _fwd(desc_q, desc_k, desc_v, O, T, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         WS: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    row0 = tl.program_id(1) * T
    q = desc_q.load([row0 + start_m, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in tl.range(0, T, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([row0 + start_n, 0])
        qk = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([row0 + start_n, 0])
        acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
        m_i = m_new
    rows = row0 + start_m + tl.arange(0, BLOCK_M)
    tl.store(O + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], (acc / l_i[:, None]).to(tl.bfloat16))


if __name__ == "__main__":
    ws = sys.argv[1] == "1"
    B, H, T, D, bm, bn = 16, 16, 1024, 128, 128, 128
    q, k, v = (torch.randn(B * H * T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = torch.empty_like(q)
    descs = [TensorDescriptor.from_tensor(t, [rows, D]) for t, rows in ((q, bm), (k, bn), (v, bn))]
    t0 = time.time()
    compiled = _fwd[(T // bm, B * H)](*descs, o, T, D ** -0.5 * 1.4426950408889634, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn,
                                      WS=ws, num_warps=4, num_stages=2)
    print(f"warp_specialize={ws}: compiled, {compiled.metadata.num_warps} warps; launched", flush=True)
    torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.view(B, H, T, D) for t in (q, k, v))).view(-1, D)
    print(f"warp_specialize={ws}: finished in {time.time() - t0:.1f} s, max error {(o.float() - ref.float()).abs().max().item():.4f}", flush=True)
