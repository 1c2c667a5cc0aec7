"""MoBA, mixture of block attention (docs/flash_attention.md §11): each query attends to its own block and the top-k
blocks its router selects.

  reference.py    the selection, the masks and the backend attention() calls (the math on the dense backends)
  op.py           the Triton path as torch.library ops and autograd: the gate, then the `tl` or the Hopper kernels
  tl_kernels.py   the `tl` kernels (gate, entry lists, forward, backward, merge)
  hopper.py       the entries laid out as one problem for the Hopper kernels (flash/hopper)
"""
