"""attention() as an nn.Module, for models that compose layers: the backend, its options, the causal flag and
the scale are fixed at construction (and checked there), the tensors come in forward."""
import torch
import torch.nn as nn

from .registry import attention, backend_options


class Attention(nn.Module):
    """softmax(q k^T * scale) v on (B, Hq, Tq, D) / (B, Hkv, Tk, D) tensors; no parameters.

        attn = Attention(backend="triton")          # causal, scale 1/sqrt(D)
        y = attn(q, k, v)                           # (B, Hq, Tq, D)
    """

    def __init__(self, backend: str = "sdpa", causal: bool = True, scale: float | None = None, **options):
        super().__init__()
        # an unknown name or option fails here, when the model is built, not at the first step
        self.options = backend_options(backend, **options)
        self.backend, self.causal, self.scale = backend, causal, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **terms) -> torch.Tensor:
        """terms: attention()'s softcap, alibi_slopes, sinks, return_lse, dropout_p for this call (a model's sinks are
        its own parameters; dropout_p is used as given: pass 0 outside training, e.g. p if self.training else 0)."""
        return attention(q, k, v, causal=self.causal, scale=self.scale, backend=self.backend, **self.options, **terms)

    def extra_repr(self) -> str:
        options = "".join(f", {name}={value}" for name, value in self.options.items())
        return f"backend={self.backend!r}, causal={self.causal}, scale={self.scale}{options}"
