"""Host time of each piece of the backward's launch path at GPT-2's shape (B=16, nh=12, T=1024, hs=64, causal, bf16).

    PYTHONPATH=. python3 benchmarks/results/2026-11-22-h200-host-path/host_probe.py

Each row: mean host microseconds per call over 300 calls (after one warm call; launch_overhead.host_us).
"compiled runner" rows launch the kernel Triton compiled for the call through CompiledKernel[grid](...),
skipping JITFunction.run's argument binding and cache lookup: what that part costs. The "(JIT)" rows call
kernel[grid](...) as the package did before attention/launch.py; the package's own rows take whatever it does now.
"""
import cProfile
import functools
import gc
import pstats
import sys

import torch
import triton

from attention import triton_flash, triton_hopper, triton_hopper_backward as hb
from attention.launch import launch
from benchmarks import launch_overhead


def host_us(fn) -> float | str:
    """launch_overhead.host_us, or why the piece cannot run this way."""
    try:
        return launch_overhead.host_us(fn, calls=300)
    except Exception as e:
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def main():
    B, H, T, D = 16, 12, 1024, 64
    qkv = torch.randn(B, T, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    scale = D ** -0.5
    o, lse = triton_flash.forward(q, k, v, True, scale)
    do = torch.randn_like(o)
    dq, dk, dv = (triton_flash.empty_bthd(B, H, T, D, q) for _ in range(3))
    n_m = triton.cdiv(T, 64)
    Tq_pad = n_m * 64
    lse2 = torch.empty(B * H, Tq_pad, dtype=torch.float32, device="cuda")
    delta = torch.empty_like(lse2)
    dq_acc = torch.empty(B * H, Tq_pad, D, dtype=torch.float32, device="cuda")
    rows_grid = (n_m, B * H)
    gl = hb.gl

    def empties():
        triton_flash.empty_bthd(B, H, T, D, q), triton_flash.empty_bthd(B, H, T, D, q)
        triton_flash.empty_bthd(B, H, T, D, q)
        torch.empty(B * H, Tq_pad, dtype=torch.float32, device=q.device)
        torch.empty(B * H, Tq_pad, dtype=torch.float32, device=q.device)
        torch.empty(B * H, Tq_pad, D, dtype=torch.float32, device=q.device)

    def descriptors():
        rows_of = lambda t: hb.TensorDescriptor(t.view(-1), [t.numel()], [1], [64], hb.ROW_LAYOUT)  # noqa: E731
        dq_block = [64, D // 2]
        return (triton_hopper.descriptor(k, 128, swizzle=D), triton_hopper.descriptor(v, 128, swizzle=D),
                triton_hopper.descriptor(q, 64), triton_hopper.descriptor(do, 64), rows_of(lse2), rows_of(delta),
                hb.TensorDescriptor(dq_acc.view(-1, D), [B * H * Tq_pad, D], [D, 1], dq_block,
                                    gl.NVMMASharedLayout.get_default_for(dq_block, gl.float32)))

    descs = descriptors()
    kd, vd, qd, dod, lsed, deltad, dqd = descs
    heads_per_group = max(1, hb.DQ_GROUP_BYTES // (Tq_pad * D * 4))
    main_args = (kd, vd, qd, dod, lsed, deltad, dk, dv, *dk.stride()[:3], *dv.stride()[:3], dqd, H, 1, B * H,
                 heads_per_group, T, Tq_pad, T, 0, scale)
    main_grid = (triton.cdiv(T, 128) * B * H,)

    def prepare():
        return hb._attn_bwd_prepare[rows_grid](o, do, lse, lse2, delta, dq_acc, *o.stride()[:3], *do.stride()[:3], H, T,
                                               Tq_pad, HEAD_DIM=D, ROWS=64)

    def main_jit():
        return hb._attn_bwd_ws[main_grid](*main_args, STAGES=2, num_warps=4, maxnreg=triton_hopper.LAUNCH_REGS)

    def finish():
        return hb._attn_bwd_finish_dq[rows_grid](dq_acc, dq, *dq.stride()[:3], H, T, Tq_pad, scale, HEAD_DIM=D,
                                                 ROWS=64)

    runner_main = main_jit()[(main_grid[0], 1, 1)]
    runner_prepare = prepare()[(*rows_grid, 1)]
    prepare_args = (o, do, lse, lse2, delta, dq_acc, *o.stride()[:3], *do.stride()[:3], H, T, Tq_pad, D, 64)
    rows = [
        ("6 torch.empty (dq, dk, dv, lse2, delta, dq_acc)", host_us(empties)),
        ("7 TensorDescriptors", host_us(descriptors)),
        ("prepare launch (JIT)", host_us(prepare)),
        ("prepare launch (compiled runner)", host_us(lambda: runner_prepare(*prepare_args))),
        ("main launch (JIT, descriptors built)", host_us(main_jit)),
        ("main launch (compiled runner)", host_us(lambda: runner_main(*main_args, 2))),
        ("finish launch (JIT)", host_us(finish)),
        ("main launch (attention.launch: kept kernel)", host_us(lambda: launch(
            hb._attn_bwd_ws, main_grid, main_args, STAGES=2, num_warps=4, maxnreg=triton_hopper.LAUNCH_REGS))),
        ("triton_hopper_backward.backward", host_us(functools.partial(hb.backward, do, q, k, v, o, lse, dq, dk, dv,
                                                                      True, scale, 2))),
        ("triton_flash._tl_backward", host_us(functools.partial(triton_flash._tl_backward, do, q, k, v, o, lse, True,
                                                                scale, triton_flash.DENSE, dq, dk, dv))),
        ("triton_flash.backward (tuner's choice)", host_us(functools.partial(triton_flash.backward, do, q, k, v, o,
                                                                             lse, True, scale))),
        ("triton_flash.forward (tuner's choice)", host_us(functools.partial(triton_flash.forward, q, k, v, True,
                                                                            scale))),
        ("torch.empty_like(lse) alone", host_us(lambda: torch.empty_like(lse))),
    ]
    gc.disable()  # does Python's garbage collector account for part of a call's host time?
    rows.append(("triton_flash.backward, garbage collector off", host_us(functools.partial(
        triton_flash.backward, do, q, k, v, o, lse, True, scale))))
    gc.enable()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| piece | host us/call |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us if isinstance(us, str) else f'{us:.1f}'} |")


def profile():
    """cProfile of the package's backward and forward launchers and of autograd.grad on the calling thread."""
    from attention import attention
    B, H, T, D = 16, 12, 1024, 64
    qkv = torch.randn(B, T, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.transpose(1, 2).requires_grad_() for t in qkv.unbind(2))
    scale = D ** -0.5
    o, lse = triton_flash.forward(q.detach(), k.detach(), v.detach(), True, scale)
    do = torch.randn_like(o)
    out = attention(q, k, v, causal=True, backend="triton")
    cases = {
        "triton_flash.backward": lambda: triton_flash.backward(do, q, k, v, o, lse, True, scale),
        "triton_flash.forward": lambda: triton_flash.forward(q, k, v, True, scale),
        "autograd.grad, calling thread": lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
        "attention() forward with grad": lambda: attention(q, k, v, causal=True, backend="triton"),
    }
    for name, fn in cases.items():
        with torch.autograd.set_multithreading_enabled(False):
            fn()
            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(300):
                fn()  # results dropped each call, as in training
            profiler.disable()
            torch.cuda.synchronize()
        print(f"\n### {name}, 300 calls")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
    if "--profile" in sys.argv:
        profile()
