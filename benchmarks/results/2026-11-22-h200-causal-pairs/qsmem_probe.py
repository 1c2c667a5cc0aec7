"""hs=128, tile (128, 3, persistent): Q in registers (the package) vs Q read from shared memory (th_qsmem.py)."""
import importlib.util, json, sys
import torch, torch.nn.functional as F, triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from attention import triton_flash, triton_hopper
spec = importlib.util.spec_from_file_location("qsmem", ".gpu_carry/th_qsmem.py")
qsmem = importlib.util.module_from_spec(spec); spec.loader.exec_module(qsmem)
for causal in (True, False):
    for T in (1024, 4096, 16384):
        B, H, D = 16384 // T, 16, 128
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        o, lse = triton_flash.empty_bthd(B, H, T, D, q), torch.empty(B, H, T, device="cuda")
        runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
        for tile in ((128, 3, True), (128, 3, False)):
            runs[f"q_regs{tile}"] = lambda tile=tile: triton_hopper.forward(q, k, v, o, lse, causal, D ** -0.5, tile)
            runs[f"q_smem{tile}"] = lambda tile=tile: qsmem.forward(q, k, v, o, lse, causal, D ** -0.5, tile)
        out = {}
        for name, fn in runs.items():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o.fill_(float("nan")); r = fn()
                diff = ((r if name == "cudnn" else o).float() - ref.float()).abs().max().item()
                out[name] = (triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), diff)
            print(json.dumps(dict(B=B, H=H, T=T, D=D, causal=causal, name=name, ms=out[name][0], max_diff_vs_cudnn=diff)), flush=True)
        print(f"T{T} {'causal' if causal else 'full'}: " + " ".join(f"{n}={out['cudnn'][0] / ms:.3f}(d{d:.4f})" for n, (ms, d) in out.items() if n != "cudnn"), file=sys.stderr)
