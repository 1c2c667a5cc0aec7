"""The naive code under torch.compile: Inductor fuses the mask, softmax and scaling into a few
kernels, but the (Tq, Tk) score matrix is still materialised, so memory stays O(T^2)."""
import torch

from .naive import naive_attention

# dynamic=None: the first new shape compiles a static graph, the second marks sizes dynamic,
# so a sweep over sequence lengths does not hit the recompile limit.
compiled_attention = torch.compile(naive_attention, dynamic=None)
