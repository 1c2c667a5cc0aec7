"""Attention under sustained load: the time per call when the GPU runs calls back to back for a second,
the energy each call draws and the SM clock it ran at, beside benchmarks/attention.py's timer (do_bench).

The H200 holds its 700 W power cap by lowering its clock. Attention at full speed runs into the cap, and
kernels that keep the tensor cores busier draw more per clock and are clocked down further. So in a
training run (and already within do_bench's 100 ms per cell) the energy a call spends weighs as much as
its kernels' time at full clock: work that a call wastes, e.g. tiles loaded and masked to nothing, costs
power even where it hides behind other work (docs/perf_notes.md).

    python -m benchmarks.sustained --family window --T 8192,16384 --hs 128,64   # ours (blocks of 64, 128) vs Flex
    python -m benchmarks.sustained --family documents --T 16384 --hs 128
    python -m benchmarks.sustained --family dense --T 16384 --hs 128 --causal false   # ours vs cuDNN
    python -m benchmarks.sustained --family dense --T 1024,4096 --passes fwd,fwd+bwd

Shapes as benchmarks/sparse.py (B*T = 16384 tokens, nh*hs = 2048), bf16, forward+backward unless --passes says
otherwise (the passes of benchmarks/attention.py, timed the same way). The energy
comes from NVML's counter (libnvidia-ml ships with the NVIDIA driver), through ctypes.
"""
import argparse
import ctypes
import time
from pathlib import Path

import torch
import triton

from attention import BlockMask, attention
from benchmarks.attention import PASSES, Shape, comma_list, forced_sdpa_backend, pass_step, registry_backend
from benchmarks.report import environment, fmt, markdown_table, parse_bool, write_json
from benchmarks.sparse import GRIDS, MASKS, flex, packed_document_ids

NVML_CLOCK_SM = 1


class Nvml:
    """The GPU's energy counter and SM clock from NVML."""

    def __init__(self, device: torch.device):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2())
        self.handle = ctypes.c_void_p()
        # by UUID: NVML numbers the GPUs without regard to CUDA_VISIBLE_DEVICES
        uuid = f"GPU-{torch.cuda.get_device_properties(device).uuid}".encode()
        self._check(self.lib.nvmlDeviceGetHandleByUUID(uuid, ctypes.byref(self.handle)))

    @staticmethod
    def _check(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"NVML call failed with status {status}")

    def energy_mj(self) -> int:
        """Millijoules used since the driver loaded."""
        value = ctypes.c_ulonglong()
        self._check(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(value)))
        return value.value

    def sm_clock_mhz(self) -> int:
        value = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(value)))
        return value.value


def sustained(step, nvml: Nvml, seconds: float, warm_s: float = 0.5, batch: int = 20) -> dict:
    """Calls back to back for warm_s (the clock settles under the cap), then for `seconds`: -> time and
    energy per call, mean SM clock. A synchronisation every `batch` calls keeps the host from running
    seconds ahead (each costs one launch latency: well under 1% of a batch of 20 calls at these sizes)."""
    def run(duration: float, clocks: list) -> int:
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < duration:
            for _ in range(batch):
                step()
            clocks.append(nvml.sm_clock_mhz())  # sampled while the batch runs
            torch.cuda.synchronize()
            calls += batch
        return calls

    run(warm_s, [])
    clocks = []
    energy, t0 = nvml.energy_mj(), time.perf_counter()
    calls = run(seconds, clocks)
    elapsed, energy = time.perf_counter() - t0, nvml.energy_mj() - energy
    return dict(sustained_us=1e6 * elapsed / calls, mj_per_call=energy / calls, sm_mhz=sum(clocks) / len(clocks))


def implementations(family: str, shape: Shape, args, device) -> dict:
    """name -> fn(q, k, v, causal); the first is the reference the others are compared with."""
    if family == "dense":
        return {"sdpa-cudnn": forced_sdpa_backend("sdpa-cudnn"), "triton": registry_backend("triton")}
    ids = packed_document_ids(shape.B, shape.T, args.doc_lengths, 0, device) if family == "documents" else None
    impls = {"flex": flex(family, args, ids, shape, device)}
    for block_size in args.block_sizes:
        window = (args.window, 0) if family == "window" else None
        mask = BlockMask.from_rules(shape.T, shape.T, causal=True, window=window, document_ids=ids,
                                    block_size=block_size, device=device)
        impls[f"triton, blocks of {block_size}"] = (
            lambda q, k, v, causal, mask=mask: attention(q, k, v, causal=causal, backend="triton", block_mask=mask))
    return impls


def measure(family: str, shape: Shape, pass_: str, args, device, nvml: Nvml) -> list[dict]:
    q, k, v = (torch.randn(shape.B, shape.nh, shape.T, shape.hs, device=device, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    rows = []
    torch._dynamo.reset()  # Flex compiles per shape, as in benchmarks/sparse.py
    for name, fn in implementations(family, shape, args, device).items():
        step = pass_step(fn, pass_, q, k, v, dout, shape.causal)
        step()  # compile, tune
        row = dict(family=family, B=shape.B, nh=shape.nh, T=shape.T, hs=shape.hs, causal=shape.causal, pass_=pass_,
                   impl=name,
                   do_bench_us=1e3 * triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"))
        rows.append(row | sustained(step, nvml, args.seconds))
        print(" ".join(f"{key}={fmt(value) if isinstance(value, float) else value}" for key, value in rows[-1].items()),
              flush=True)
    return rows


def report(rows: list[dict], env: dict, seconds: float) -> str:
    header = ["family", "T", "hs", "causal", "pass", "implementation", "do_bench us", "x ref", "sustained us",
              "x ref", "mJ / call", "SM MHz"]
    table, reference = [], None
    for row in rows:
        if reference is None or any(reference[key] != row[key] for key in ("family", "T", "hs", "causal", "pass_")):
            reference = row  # the first implementation of each shape and pass
        table.append([row["family"], row["T"], row["hs"], row["causal"], row["pass_"], row["impl"],
                      fmt(row["do_bench_us"]),
                      fmt(reference["do_bench_us"] / row["do_bench_us"]), fmt(row["sustained_us"]),
                      fmt(reference["sustained_us"] / row["sustained_us"]), fmt(row["mj_per_call"]),
                      fmt(row["sm_mhz"])])
    return (f"# Attention under sustained load\n\n{env['gpu']}, driver {env['driver']}, torch {env['torch']}, "
            f"triton {env['triton']}, bf16, {env['date']}.\n\n"
            "- do_bench: median, L2 flushed before each call, 100 ms per implementation "
            "(benchmarks/attention.py's timer)\n"
            f"- sustained: calls back to back for {seconds:g} s after 0.5 s of the same; energy from NVML's "
            "counter; SM clock sampled every 20 calls\n"
            "- x ref: the first implementation's time / this one's (above 1: faster)\n\n"
            + markdown_table(header, table))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("dense", "window", "documents"), default="window")
    p.add_argument("--T", type=comma_list(int), default=[16384])
    p.add_argument("--hs", type=comma_list(int), default=[128])
    p.add_argument("--causal", type=parse_bool, default=True, help="dense only; the masks are causal")
    p.add_argument("--block_sizes", type=comma_list(int), default=[64, 128], help="BlockMask block sizes of ours")
    p.add_argument("--passes", type=comma_list(str), default=["fwd+bwd"], help="fwd, bwd, fwd+bwd")
    p.add_argument("--seconds", type=float, default=1.0, help="sustained measurement per implementation")
    p.add_argument("--out_dir", type=Path, default=Path("out/sustained"))
    args = p.parse_args(argv)
    for pass_ in args.passes:
        if pass_ not in PASSES:
            p.error(f"unknown pass {pass_!r}; choose from {', '.join(PASSES)}")
    vars(args).update({key: value for key, value in MASKS["gpu"].items() if key != "block_size"})
    device = torch.device("cuda")
    nvml = Nvml(device)
    rows = []
    for hs in args.hs:
        for T in args.T:
            tokens, width = GRIDS["full"]["tokens"], GRIDS["full"]["width"]
            shape = Shape(max(1, tokens // T), width // hs, T, hs, causal=args.causal or args.family != "dense",
                          group="grid")
            for pass_ in args.passes:
                rows += measure(args.family, shape, pass_, args, device, nvml)
    env = environment(device)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / f"{args.family}.json", dict(environment=env, seconds=args.seconds, rows=rows))
    text = report(rows, env, args.seconds)
    (args.out_dir / f"{args.family}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
