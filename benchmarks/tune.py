"""Time the tuner's candidates for the shapes users run on this GPU, and write the choices the repository ships for its
model (attention/flash/tuned/<gpu>.json.gz), so that a first run there times nothing (attention/flash/tuner.py).

    python -m benchmarks.tune                              # into attention/flash/tuned/
    python -m benchmarks.tune --out_dir DIR --seq_lens 1024,4096

Every key is timed afresh: the choices kept on disk and those shipped are set aside for the run. The keys: dense
causal and full attention in bf16 at head dims 64 and 128, forward and backward, sequence lengths in power-of-two
buckets (the tuner's key), so the kernel grid, GPT-2's training step and long-context runs find theirs.
"""
import argparse
import os
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from attention import attention
from attention.flash import tuner

SEQ_LENS = (256, 512, 1024, 2048, 4096, 8192, 16384)
TOKENS = 16384  # B * T of each call, as the kernel grid's (benchmarks/attention.py)
WIDTH = 2048  # nh * hs


def tune(seq_lens, head_dims, dtype) -> int:
    """Run a forward and backward of every shape (the tuner times each new key); -> how many keys were timed."""
    for hs in head_dims:
        for T in seq_lens:
            for causal in (True, False):
                B, nh = max(1, TOKENS // T), WIDTH // hs
                qkv = torch.randn(B, T, 3, nh, hs, device="cuda", dtype=dtype)
                q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in qkv.unbind(2))
                out = attention(q, k, v, causal=causal, backend="triton")
                out.backward(torch.randn_like(out))  # a dO the copy engine reads: .sum()'s is a stride-0 view
                print(f"hs={hs} T={T} causal={causal}: {len(tuner.best_tile)} kernel keys, "
                      f"{len(tuner.best_backward)} backward keys", flush=True)
    return len(tuner.best_tile) + len(tuner.best_backward)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default=str(tuner.SHIPPED_CHOICES))
    p.add_argument("--seq_lens", default=",".join(map(str, SEQ_LENS)))
    p.add_argument("--head_dims", default="64,128")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as empty:
        tuner.SHIPPED_CHOICES = Path(empty) / "none"  # time every key, whatever is shipped
        os.environ["NANOFLASH_CACHE_DIR"] = empty  # and whatever this machine kept
        keys = tune([int(t) for t in args.seq_lens.split(",")], [int(d) for d in args.head_dims.split(",")],
                    torch.bfloat16)
        path = tuner.choices_store(torch.cuda.current_device()).export(args.out_dir)
    print(f"{keys} keys timed on {torch.cuda.get_device_name()}: {path}")


if __name__ == "__main__":
    main()
