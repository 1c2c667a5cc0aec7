"""The readable reference: build the full (Tq, Tk) score matrix, mask, softmax, weight the values.

Memory is O(T^2) per head, which is exactly what the flash backends avoid; this is the backend
to read first and to check the others against. It computes every term attention() takes (softcap, ALiBi, sinks,
the log-sum-exp, a value head dim of its own) as written in docs/flash_attention.md §15, in float64 when given
float64.
"""
import torch

from ..masks import causal_mask


def naive_attention(q, k, v, causal: bool, scale: float, visible: torch.Tensor | None = None, softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                    return_lse: bool = False, dropout_p: float = 0.0, keep: torch.Tensor | None = None):
    """visible: bool broadcastable to (B, Hq, Tq, Tk), True where a query may see a key (masks.py builds
    it for windows, documents and mask functions); given, it replaces the causal mask, which it must
    then already include. softcap: scores s become softcap * tanh(s / softcap) (0: off). alibi_slopes (Hq,) or
    (B, Hq): -slope * |i + Tk - Tq - j| added to the (capped) scores. sinks (Hq,): a logit per head that joins every
    row's softmax denominator and weights no value. return_lse: also -> each row's natural log-sum-exp (B, Hq, Tq),
    the sink's term included, +inf for a row that sees nothing (float32, float64 for float64 inputs).
    dropout_p: each probability dropped with this probability, the kept ones scaled by 1 / (1 - dropout_p) (§16;
    the log-sum-exp is the undropped one's); keep: the (B, Hq, Tq, Tk) bool mask to drop by (the tests' reference,
    from flash/dropout.py:keep_mask), else torch's dropout draws one."""
    B, Hq, Tq, Tk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] != Hq:  # grouped-query attention: each k/v head serves Hq // Hkv query heads
        k = k.repeat_interleave(Hq // k.shape[1], dim=1)
        v = v.repeat_interleave(Hq // v.shape[1], dim=1)
    att = (q @ k.transpose(-2, -1)) * scale  # (B, nh, Tq, Tk)
    # softmax in at least fp32: in fp16/bf16 exp() of the row would lose most of its precision
    att = att.to(torch.promote_types(att.dtype, torch.float32))
    if softcap:
        att = softcap * torch.tanh(att / softcap)
    if alibi_slopes is not None:
        # the key's distance from the query's position i + Tk - Tq (bottom-right aligned, as the causal mask)
        distance = (torch.arange(Tq, device=q.device)[:, None] + (Tk - Tq) - torch.arange(Tk, device=q.device)).abs()
        slopes = alibi_slopes.to(att.dtype).view(-1, Hq, 1, 1)  # (1 or B, Hq, 1, 1)
        att = att - slopes * distance.to(att.dtype)
    if visible is None and causal:
        visible = causal_mask(Tq, Tk, device=q.device)  # (Tq, Tk)
    if visible is not None:
        att = att.masked_fill(~visible, float("-inf"))
    logits = att
    if sinks is not None:
        # the sink is one more column of the row: in the denominator, with no value behind it
        logits = torch.cat([att, sinks.to(att.dtype).view(1, Hq, 1, 1).expand(B, Hq, Tq, 1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(att, dim=-1)
    blind = None
    if visible is not None and sinks is None:
        # a query with no visible key gets softmax(all -inf) = NaN; define it as 0. Its gradient stays
        # finite: the softmax backward is NaN on that row, but the -inf fill above passes no gradient
        # to masked entries, which in such a row are all of them. (A sink keeps every row's sum above 0.)
        blind = ~visible.any(dim=-1, keepdim=True)
        probs = probs.masked_fill(blind, 0.0)
    if keep is not None:
        probs = probs.masked_fill(~keep, 0.0) / (1 - dropout_p)
    elif dropout_p:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    out = probs.to(v.dtype) @ v  # (B, nh, Tq, Tk) x (B, nh, Tk, Dv) -> (B, nh, Tq, Dv)
    if not return_lse:
        return out
    lse = torch.logsumexp(logits.detach(), dim=-1)
    if blind is not None:
        lse = lse.masked_fill(blind[..., 0], float("inf"))  # the kernels' convention for a row that sees nothing (§8)
    return out, lse
