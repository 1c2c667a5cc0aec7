"""§15 and §16: FlashAttention's terms a call adds to softmax attention (softcap, ALiBi, sinks, dropout, a value head
dim of its own), what the kernels are told of them, and the sinks' gradient.

    terms = terms_of(softcap, alibi_slopes, sinks, dropout_p, dropout_seed)   # NO_TERMS itself for a plain call
    term_constants(terms, q, v, "fwd")   # the constexpr switches a kernel compiles in
    term_args(terms, forward=True)       # the kernels' term arguments, None where a term is off

dispatch.py passes them to the kernels and decides which kernels may take a call (plain_call, hopper_call).
"""
from typing import NamedTuple

import torch
import triton

from .device import softcap_tanh


class Terms(NamedTuple):
    """§15: FlashAttention's terms a call adds to softmax attention, all off by default. The kernels compile each one
    in only where a call uses it (a constexpr switch), so a call without them runs the kernels as they were."""
    softcap: float = 0.0  # > 0: scores s become softcap * tanh(s / softcap)
    alibi_slopes: torch.Tensor | None = None  # (Hq,) or (B, Hq) float32: -slope * |i + Tk - Tq - j| added to scores
    sinks: torch.Tensor | None = None  # (Hq,) a logit per head in every row's softmax denominator (forward only)
    # §16 > 0: each probability dropped with this probability, the kept ones scaled by 1 / (1 - dropout_p), the mask
    # drawn by Philox from dropout_seed ((1,) int64 on q's device, dropout.draw_seed's), regenerated in the backward
    dropout_p: float = 0.0
    dropout_seed: torch.Tensor | None = None


NO_TERMS = Terms()


def terms_of(softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
             dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None) -> Terms:
    """Terms(softcap, alibi_slopes, sinks, dropout_p, dropout_seed), or NO_TERMS itself for a call without any: the
    plain path tells it by identity (host time on every call)."""
    if not softcap and alibi_slopes is None and sinks is None and not dropout_p:
        return NO_TERMS
    return Terms(softcap, alibi_slopes, sinks, dropout_p, dropout_seed if dropout_p else None)


def plain_call(terms: Terms, q: torch.Tensor, v: torch.Tensor) -> bool:
    """No §15 term, no dropout (§16) and one head dim for q, k, v: what the Hopper kernels take."""
    return (not terms.softcap and terms.alibi_slopes is None and terms.sinks is None and not terms.dropout_p
            and v.shape[-1] == q.shape[-1])


def hopper_call(terms: Terms, q: torch.Tensor, v: torch.Tensor) -> bool:
    """What the Hopper kernels (§12, §13) compute of a dense call's terms: softcap, ALiBi and sinks (§15) and dropout
    (§16: the `tl` kernels' mask, so either family's backward regenerates the other's forward's), compiled in where a
    call has them; not a value head dim of its own, which only the `tl` kernels compute. (With sinks and softcap
    together the backward stays on the `tl` kernels: dispatch._backward_plan.)"""
    return v.shape[-1] == q.shape[-1]


def term_constants(terms: Terms, q: torch.Tensor, v: torch.Tensor, kernel: str) -> dict:
    """The §15 switches of a call's kernel ("fwd", "dq", "dkdv"), only those it turns on: a call without them has the
    constants (and so the tuning keys, and the choices shipped for them, §9) it had before they existed."""
    constants = {}
    if terms.softcap:
        constants["SOFTCAP"] = softcap_tanh(q.device)  # which tanh (device.softcap_tanh)
    if terms.alibi_slopes is not None:
        constants["ALIBI"] = True
    if terms.sinks is not None and kernel != "dkdv":  # the forward's sink; the dQ kernel's rows for its gradient
        constants["SINKS"] = True
    if terms.dropout_p:  # §16, in all three kernels
        constants["DROPOUT"] = True
    if v.shape[-1] != q.shape[-1]:
        constants.update(HEAD_DV=v.shape[-1], BLOCK_DV=triton.next_power_of_2(v.shape[-1]))
    return constants


def term_args(terms: Terms, forward: bool) -> tuple:
    """The kernels' softcap, SLOPES, stride_slopes_b, stride_slopes_h (and the forward's SINK_LOGITS, stride_sinks),
    then dropout_p, SEED (§16): None where a term is off, which Triton compiles as a constant."""
    slopes, sinks = terms.alibi_slopes, terms.sinks
    slope_strides = (None, None) if slopes is None else (0, slopes.stride(0)) if slopes.dim() == 1 else slopes.stride()
    args = (terms.softcap or None, slopes, *slope_strides)
    if forward:
        args += (sinks, None if sinks is None else sinks.stride(0))
    return args + (terms.dropout_p or None, terms.dropout_seed)


def term_values(terms: Terms, forward: bool) -> tuple:
    """The values of the terms a call uses, in Terms' order, which its plan takes anew with every call."""
    if terms is NO_TERMS:
        return ()
    return tuple(x for x in (terms.softcap or None, terms.alibi_slopes, terms.sinks if forward else None,
                             terms.dropout_p or None, terms.dropout_seed) if x is not None)


def with_values(terms: Terms, values: tuple, forward: bool) -> Terms:
    """terms with the values of another call of its plan (term_values(terms, forward)'s)."""
    given = iter(values)
    used = (bool(terms.softcap), terms.alibi_slopes is not None, terms.sinks is not None and forward,
            bool(terms.dropout_p), terms.dropout_seed is not None)
    return Terms(*(next(given) if on else off for on, off in zip(used, NO_TERMS)))


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, varlen: bool) -> torch.Tensor:
    """§15 the sinks' gradient, d sink_h = -sum over head h's rows of P_sink * Delta: P_sink = exp(sink_h - lse) is
    the sink's probability in the row, Delta = sum_j P_j dP_j (§5) as the dQ kernel summed it (exact products, fp32
    sums: rowsum(dO * O) would carry O's rounding to the inputs' dtype into a sum over every row of the head).
    lse, delta (B, Hq, Tq); varlen: (Hq, total_q)."""
    p_sink = torch.exp(sinks.float()[:, None] - lse)  # (Hq, 1) against (B, Hq, Tq), or (Hq, total_q)
    return (-(p_sink * delta).sum((1,) if varlen else (0, 2))).to(sinks.dtype)
