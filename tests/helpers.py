"""What more than one test module uses: fresh random inputs, the float64 error criterion, shared checks and tools, and
train.py runs (the tiny run's settings; in this process as a command line would end, or in a subprocess on the
CPU; a NaN injected into a loss).

Test modules import it as `from helpers import ...` (pytest's default import mode puts tests/ on sys.path, whether
it runs from the repository root or from tests/); no test module imports another. Kernel modules (triton_*) are
imported inside the functions that need them: Triton decides when they are first imported whether their kernels run
in the CPU interpreter, and conftest.py sets TRITON_INTERPRET=1 first.

The error criterion of every kernel test: each output and gradient, compared with the same computation in float64,
may be off by at most twice what PyTorch's own attention in the same dtype (the naive backend, or a backend's dense
reference) is off by, plus 1e-5. The error is the largest absolute one: a bug confined to one tile (a wrong mask on
the diagonal, a ragged edge) shows up in a few elements, which a norm over the tensor would dilute.
"""
import itertools
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np
import pytest
import torch

from attention import attention, attention_qkvpacked, attention_varlen, get_backend, register_backend
from data.shards import shard_path, write_index, write_shard
from training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]  # the repository

# the keys of every train record in metrics.jsonl (train.py and examples/train_llama.py write the same format);
# train.py's records add whether the step was skipped for a non-finite loss or gradient norm, and how many were so far
TRAIN_KEYS = {"step", "train_loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "mfu", "peak_mem_gb", "attn",
              "warmup"}
TRAIN_PY_KEYS = TRAIN_KEYS | {"skipped", "skipped_steps"}


# ---------------------------------------------------------------------------------------------------------------------
# random inputs


def _generator(seed: int | None, device) -> torch.Generator | None:
    return None if seed is None else torch.Generator(device).manual_seed(seed)


def qkv(B=1, Hq=2, Hkv=2, Tq=37, Tk=37, D=32, dtype=torch.float32, device="cpu", *, seed: int | None = None,
        requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh standard-normal q (B, Hq, Tq, D), k and v (B, Hkv, Tk, D), contiguous. seed: drawn from a generator of
    their own (the same tensors every time); None: from torch's global generator (torch.manual_seed)."""
    generator = _generator(seed, device)
    q, k, v = (torch.randn(B, H, T, D, dtype=dtype, device=device, generator=generator)
               for H, T in ((Hq, Tq), (Hkv, Tk), (Hkv, Tk)))
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def packed_qkv(B=2, T=37, nh=2, hs=24, dtype=torch.float32, device="cpu", *, seed: int | None = None) -> torch.Tensor:
    """Fresh random (B, T, 3, nh, hs): a fused qkv projection's output viewed per head, what attention_qkvpacked
    takes (model.py passes it so)."""
    return torch.randn(B, T, 3, nh, hs, dtype=dtype, device=device, generator=_generator(seed, device))


def projection_views(B=2, T=37, nh=2, hs=24, dtype=torch.float32, device="cpu", *, seed: int | None = None):
    """q, k, v (B, nh, T, hs) as a model makes them from a fresh random (B, T, 3 * nh * hs) projection: split in
    three, heads viewed, transposed. Strided views of one tensor, none of them contiguous."""
    proj = torch.randn(B, T, 3 * nh * hs, dtype=dtype, device=device, generator=_generator(seed, device))
    return tuple(t.view(B, T, nh, hs).transpose(1, 2) for t in proj.split(nh * hs, dim=2))


def random_tokens(B: int, T: int, vocab: int, seed: int = 1, device="cpu") -> torch.Tensor:
    """(B, T) token ids drawn uniformly from [0, vocab), the same for the same seed."""
    return torch.randint(0, vocab, (B, T), device=device, generator=torch.Generator(device).manual_seed(seed))


def packed_document_ids(B: int, T: int, lengths_per_row: list[list[int]]) -> torch.Tensor:
    """(B, T) ids of packed documents: row b holds documents of the given lengths, the last one cut at T."""
    rows = []
    for lengths in lengths_per_row:
        ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        rows.append(ids[:T])
    return torch.stack(rows)


def token_shards(folder: Path, vocab: int, sizes: dict[str, int], phrase: int | None = None, noise: float = 0.0,
                 seed: int = 0, shards: int = 1) -> Path:
    """Token shards in the data package's format in folder (split -> number of tokens), and their index.json, as
    the preparation scripts write them: a repeating random phrase of `phrase` tokens with a `noise` fraction of
    random tokens (learnable within a few steps), or with phrase None uniform random tokens. shards: how many files
    each split's tokens are cut into (equal parts). -> folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    repeated = None if phrase is None else rng.integers(0, vocab, phrase)
    for split, n_tokens in sizes.items():
        if repeated is None:
            tokens = rng.integers(0, vocab, n_tokens)
        else:
            tokens = np.resize(repeated, n_tokens)
            mixed = rng.random(n_tokens) < noise
            tokens[mixed] = rng.integers(0, vocab, mixed.sum())
        for i, part in enumerate(np.array_split(tokens.astype(np.uint16), shards)):
            write_shard(shard_path(str(folder), split, i), part)
    write_index(str(folder), "tests/helpers.py token_shards")
    return folder


# ---------------------------------------------------------------------------------------------------------------------
# the float64 criterion


def out_and_grads(fn, q, k, v, do):
    """fn(q, k, v) and its gradients for the upstream gradient do, on fresh leaves that keep the inputs' strides
    (detach() shares storage), so strided views reach the kernel as views."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def assert_errors_within(names, exact, reference, ours) -> None:
    """For each named tensor: max |ours - exact| <= 2 * max |reference - exact| + 1e-5, exact computed in float64 and
    reference in the dtype of ours (module docstring). A NaN in ours fails."""
    for name, ref, theirs, mine in zip(names, exact, reference, ours, strict=True):
        assert mine.shape == ref.shape, f"{name}: shape {tuple(mine.shape)}, expected {tuple(ref.shape)}"
        err_ref = (theirs.double() - ref).abs().max().item()
        err_ours = (mine.double() - ref).abs().max().item()
        assert err_ours <= 2 * err_ref + 1e-5, f"{name}: error {err_ours:.3g} vs the reference's {err_ref:.3g}"


def assert_fn_matches_fp64(fn: Callable, reference: Callable, q, k, v):
    """fn(q, k, v) and its dq, dk, dv against reference on float64 copies, judged by reference in q's dtype.
    -> fn's (out, dq, dk, dv), for further checks."""
    do = torch.randn(q.shape, dtype=q.dtype, device=q.device)  # the output is shaped like q
    exact = out_and_grads(reference, q.double(), k.double(), v.double(), do.double())
    math = out_and_grads(reference, q, k, v, do)
    ours = out_and_grads(fn, q, k, v, do)
    for name, t in zip(("out", "dq", "dk", "dv"), ours):
        assert t.dtype == q.dtype, f"{name} is {t.dtype}, q {q.dtype}"
    assert_errors_within(("out", "dq", "dk", "dv"), exact, math, ours)
    return ours


def assert_matches_fp64(q, k, v, causal=True, scale=None, backend="triton", reference: Callable | None = None,
                        **kwargs):
    """attention(q, k, v, causal, scale, backend=backend, **kwargs), forward and dq, dk, dv, against float64 by the
    criterion of the module docstring. kwargs: window / document_ids / block_mask, and the backend's options.
    reference(q, k, v): the computation in float64 and in q's dtype; by default the naive backend (PyTorch's math
    attention) with the same kwargs, which a backend computing another function (MoBA) must replace."""
    def call(name):
        return lambda *t: attention(*t, causal, scale, backend=name, **kwargs)

    ours = call(backend)
    if backend == "triton" and not kwargs:
        # the kernels' own entry point, which attention() calls for this: with it a single causal query stays
        # causal (attention() drops the flag, which cannot hide a key from the last position)
        from attention.flash.autograd import flash_attention

        ours = lambda *t: flash_attention(*t, causal, scale)  # noqa: E731
    return assert_fn_matches_fp64(ours, reference or call("naive"), q, k, v)


def assert_qkvpacked_matches_fp64(qkv_packed, backend="triton", reference: Callable | None = None, **kwargs):
    """attention_qkvpacked(qkv_packed, backend=backend, **kwargs): output and the gradient of qkv against float64,
    judged as assert_matches_fp64 does; reference(packed) by default the naive backend with the same kwargs.
    -> (out, dqkv) for further checks."""
    B, T, _, nh, hs = qkv_packed.shape
    do = torch.randn(B, nh, T, hs, dtype=qkv_packed.dtype, device=qkv_packed.device)

    def run(fn, packed, do):
        packed = packed.detach().requires_grad_()
        out = fn(packed)
        return out, *torch.autograd.grad(out, packed, do)

    ours_fn = lambda packed: attention_qkvpacked(packed, backend=backend, **kwargs)  # noqa: E731
    reference = reference or (lambda packed: attention_qkvpacked(packed, backend="naive", **kwargs))
    exact, math = run(reference, qkv_packed.double(), do.double()), run(reference, qkv_packed, do)
    ours = run(ours_fn, qkv_packed, do)
    for name, t in zip(("out", "dqkv"), ours):
        assert t.dtype == qkv_packed.dtype, f"{name} is {t.dtype}, qkv {qkv_packed.dtype}"
    assert_errors_within(("out", "dqkv"), exact, math, ours)
    return ours


# ---------------------------------------------------------------------------------------------------------------------
# other checks


def assert_bitwise_deterministic(q, k, v, backend="triton", **kwargs) -> None:
    """Two forward+backward runs of attention() on the same inputs agree bit for bit (no atomics anywhere)."""
    do = torch.randn_like(q)
    run = lambda *t: attention(*t, backend=backend, **kwargs)  # noqa: E731
    first, second = out_and_grads(run, q, k, v, do), out_and_grads(run, q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), name


def assert_compiled_matches_eager(B, T, nh, hs, dtype, device, tol, packed=False) -> None:
    """torch.compile(fullgraph=True) of a model's attention path (fused qkv projection, head views or with packed
    the (B, T, 3, nh, hs) view model.py passes, the Triton kernel, heads merged back) gives eager's output and
    gradients. fullgraph=True fails on any graph break, e.g. an operator without a fake implementation."""
    from attention.flash.autograd import flash_attention

    C = nh * hs

    def block(x, w):
        if packed:
            y = attention_qkvpacked((x @ w).view(B, T, 3, nh, hs), backend="triton")
        else:
            q, k, v = (x @ w).split(C, dim=2)
            y = flash_attention(*(t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v)))
        return y.transpose(1, 2).contiguous().view(B, T, C)

    x = torch.randn(B, T, C, dtype=dtype, device=device)
    w = torch.randn(C, 3 * C, dtype=dtype, device=device) * C**-0.5
    do = torch.randn(B, T, C, dtype=dtype, device=device)

    def run(fn):
        x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(x_, w_)
        out.backward(do)
        return out, x_.grad, w_.grad

    for eager, compiled in zip(run(block), run(torch.compile(block, fullgraph=True))):
        torch.testing.assert_close(compiled, eager, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------------------------------
# tools


def whole_paths(monkeypatch) -> list[str]:
    """Records each call of the Triton kernels that took the whole path (and so built a launch plan) instead of
    running a kept plan (attention/flash/dispatch.py): "_forward_plan", "_backward_plan"."""
    from attention.flash import dispatch

    taken = []
    for name in ("_forward_plan", "_backward_plan"):
        whole_path = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *args, _path=whole_path, _name=name: taken.append(_name)
                            or _path(*args))
    return taken


def registered_backend(monkeypatch, name: str, fn: Callable, supports_masks: bool = False, **abilities):
    """register_backend(name, fn, supports_masks, **abilities) for one test: the registry is as before once the test
    ends (register_backend itself is for good). -> its attention.Backend."""
    from attention import registry

    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    register_backend(name, fn, supports_masks, **abilities)
    return get_backend(name)


def markdown_section(md: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the table under `## heading`."""
    lines = md.split(f"## {heading}\n", 1)[1].lstrip("\n").splitlines()
    table = [[c.strip() for c in line.strip("|").split("|")]
             for line in itertools.takewhile(lambda line: line.startswith("|"), lines)]
    return table[0], table[2:]


# ---------------------------------------------------------------------------------------------------------------------
# train.py runs


# the tiny run most train.py tests make: 2 layers, 2 heads of 16 channels, 16-token context, 4 sequences per batch,
# on conftest.py's data_dir
TINY_VOCAB = 64
TINY_RUN = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=TINY_VOCAB, batch_size=4, device="cpu",
                wandb=False, sample_interval=0, eval_interval=0, eval_iters=2, log_interval=1,
                checkpoint_interval=0, warmup_steps=2, learning_rate=1e-2, min_lr=1e-3, seed=0)


def tiny_run_shards(folder: Path) -> Path:
    """Shards in the data package's format: a repeating 40-token phrase with 10% random tokens, learnable enough for
    the loss to fall within a few steps."""
    return token_shards(folder, TINY_VOCAB, {"train": 20_000, "val": 4_000}, phrase=40, noise=0.1)


def tiny_config(out_dir, data_dir, **overrides) -> TrainConfig:
    """The tiny run's TrainConfig."""
    return TrainConfig(**{**TINY_RUN, "out_dir": str(out_dir), "data_dir": data_dir, **overrides})


def tiny_argv(out_dir, data_dir, **overrides) -> list[str]:
    """train.py's command line for the tiny run's settings."""
    return cli_flags(**{**TINY_RUN, "out_dir": out_dir, "data_dir": data_dir, **overrides})


def cli_flags(**settings) -> list[str]:
    return [f"--{k}={v}" for k, v in settings.items()]


def cpu_env(**changes) -> dict[str, str]:
    """This process's environment for a train.py subprocess on the CPU (CUDA_VISIBLE_DEVICES="": the CPU path even
    on a GPU machine), unbuffered so that a reader sees lines as they are printed; changes: None removes a name."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", **changes}
    return {k: v for k, v in env.items() if v is not None}


def run_cli(*args, timeout=120, env=None, **popen_kwargs) -> subprocess.CompletedProcess:
    """python *args in the repository on the CPU; text output captured."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env or cpu_env(), capture_output=True, text=True,
                          timeout=timeout, **popen_kwargs)


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """train.main(argv) in this process, as `python train.py *argv` would end: -> (exit status, stdout, stderr).
    sys.exit's message goes to stderr as Python prints it; any other exception becomes exit status 1 and its
    traceback in stderr, as an uncaught one would."""
    import train

    capsys.readouterr()  # what came before is not this run's
    try:
        train.main(argv)
        status, message = 0, ""
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        message = "" if isinstance(stop.code, int) or stop.code is None else f"{stop.code}\n"
    except Exception:
        status, message = 1, traceback.format_exc()
    out, err = capsys.readouterr()
    return status, out, err + message


def read_metrics(out_dir) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl's (train records, val records)."""
    records = [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]
    return [r for r in records if "train_loss" in r], [r for r in records if "val_loss" in r]


def nan_loss_forward(forward: Callable, calls: Collection[int], keep_grad: bool = False) -> Callable:
    """GPT.forward, except that the training calls (model.training, with targets) numbered in calls (0, 1, ... in this
    process; with one micro-batch per step, the steps since the run started or resumed) return a NaN loss. keep_grad:
    the loss's value alone is NaN, its gradient is the true one (the gradient norm stays finite), else the gradients
    are NaN too. Use: monkeypatch.setattr(GPT, "forward", nan_loss_forward(GPT.forward, {2}))."""
    seen = 0

    def poisoned(self, idx, targets=None, *args, **kwargs):
        nonlocal seen
        logits, loss = forward(self, idx, targets, *args, **kwargs)
        if self.training and targets is not None:
            if seen in calls:
                nan = torch.full_like(loss, float("nan"))
                loss = nan + (loss - loss.detach()) if keep_grad else loss * nan
            seen += 1
        return logits, loss

    return poisoned


# ---------------------------------------------------------------------------------------------------------------------
# FlashAttention's terms (docs/flash_attention.md §15): test_terms.py on the CPU, test_terms_gpu.py

def slopes_for(B, Hq, per_batch=False):
    """ALiBi's geometric slopes 2^(-8 h / Hq), per batch row slightly apart with per_batch."""
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / Hq) for h in range(Hq)], dtype=torch.float32)
    return slopes * torch.linspace(1, 1.5, B)[:, None] if per_batch else slopes


# name -> attention()'s keywords for (B, Hq) = (2, 4)
TERM_CASES = {
    "softcap": lambda: dict(softcap=2.5),
    "alibi": lambda: dict(alibi_slopes=slopes_for(2, 4)),
    "alibi per batch": lambda: dict(alibi_slopes=slopes_for(2, 4, per_batch=True)),
    "sinks": lambda: dict(sinks=torch.randn(4)),
    "all": lambda: dict(softcap=3.0, alibi_slopes=slopes_for(2, 4, per_batch=True), sinks=torch.randn(4) + 2),
}


def assert_terms_match_fp64(q, k, v, causal=True, scale=None, backend="triton", varlen=None, sinks=None, **terms):
    """attention(..., return_lse=True, **terms), or with varlen = (cu_q, cu_k, max_q, max_k) attention_varlen: out,
    lse and the gradients of q, k, v and the sinks against the naive backend in float64, judged by the naive backend
    in q's dtype (helpers.py's criterion). lse: the same rows +inf, the others within the criterion."""
    do = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)

    def run(name, q, k, v, sinks, do):
        leaves = [t.detach().requires_grad_() for t in (q, k, v) + (() if sinks is None else (sinks,))]
        extra = {} if sinks is None else {"sinks": leaves[3]}
        if varlen is None:
            out, lse = attention(*leaves[:3], causal, scale, backend=name, return_lse=True, **terms, **extra)
        else:
            out, lse = attention_varlen(*leaves[:3], *varlen, causal=causal, softmax_scale=scale, backend=name,
                                        return_lse=True, **terms, **extra)
        return (out, *torch.autograd.grad(out, leaves, do)), lse

    exact, exact_lse = run("naive", q.double(), k.double(), v.double(), None if sinks is None else sinks.double(),
                           do.double())
    math, math_lse = run("naive", q, k, v, sinks, do)
    ours, lse = run(backend, q, k, v, sinks, do)
    names = ("out", "dq", "dk", "dv", "dsinks")[:len(ours)]
    for name, t, like in zip(names, ours, (q, q, k, v, sinks)):
        assert t.dtype == like.dtype, f"{name} is {t.dtype}"
    assert_errors_within(names, exact, math, ours)
    assert lse.dtype == torch.float32 and lse.shape == exact_lse.shape
    blind = torch.isinf(exact_lse)
    assert torch.equal(torch.isinf(lse), blind) and (lse[blind] > 0).all(), "rows that see nothing: lse +inf"
    assert_errors_within(["lse"], [exact_lse[~blind]], [math_lse[~blind]], [lse[~blind]])
    return ours


def terms_for(case: str, B: int, Hq: int, device="cpu") -> dict:
    """attention()'s keywords for a TERM_CASES name (or "alibi and sinks", the Hopper backward's sinks) and these
    batch and head counts."""
    torch.manual_seed(10)
    slopes = slopes_for(B, Hq, per_batch=True)
    terms = {"softcap": dict(softcap=2.5), "alibi": dict(alibi_slopes=slopes[0]),
             "alibi per batch": dict(alibi_slopes=slopes), "sinks": dict(sinks=torch.randn(Hq)),
             "all": dict(softcap=3.0, alibi_slopes=slopes, sinks=torch.randn(Hq) + 2),
             "alibi and sinks": dict(alibi_slopes=slopes, sinks=torch.randn(Hq) + 2)}[case]
    return {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in terms.items()}


def assert_compiled_like_eager(fn, inputs, tol):
    """torch.compile(fn, fullgraph=True) gives eager's output and the gradients of every input (a graph break fails)."""
    def run(f):
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = f(*leaves)
        return (out, *torch.autograd.grad(out, leaves, torch.ones_like(out)))

    for eager, compiled in zip(run(fn), run(torch.compile(fn, fullgraph=True))):
        torch.testing.assert_close(compiled, eager, rtol=tol, atol=tol)


def spy_on_hopper_kernels(monkeypatch) -> list:
    """Record each launch of the Hopper forward and backward (their whole path: a plan's repeats are not recorded) as
    (kind, its term_args, its documents), and let it run; skip where they cannot run (an sm_90 GPU, Gluon)."""
    from attention.flash import device
    from attention.flash.hopper import backward as hopper_backward
    from attention.flash.hopper import forward as hopper_forward

    if not (device.HAS_GLUON and device.is_hopper(torch.device("cuda"))):
        pytest.skip("the Hopper kernels run on an sm_90 GPU")
    taken = []

    def spy(kind, launch):
        def recorded(*args, **kwargs):
            taken.append((kind, kwargs.get("term_args"), args[12] if kind == "bwd" and len(args) > 12
                          else args[8] if kind == "fwd" and len(args) > 8 else None))
            return launch(*args, **kwargs)
        return recorded
    monkeypatch.setattr(hopper_forward, "forward", spy("fwd", hopper_forward.forward))
    monkeypatch.setattr(hopper_backward, "backward", spy("bwd", hopper_backward.backward))
    return taken
