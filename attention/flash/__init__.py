"""The Triton path: FlashAttention in `tl` everywhere, and on Hopper warp-specialized in Gluon (hopper/).

A call runs through, in this order:

  autograd.py    the autograd Functions and torch.library ops the registry calls (eager and torch.compile)
  dispatch.py    forward() and backward(): which kernels run, and the launch plans that repeat a seen call
  tuner.py       on a key's first call, the fastest tile, timed or read from the choices kept on disk
  launch.py      the launch itself, kept bound for calls that specialise alike

beside them: device.py (what runs where), tiles.py (the `tl` kernels' tiles), tuning_store.py (choices on disk),
ops.py (operator definitions); the `tl` kernels in tl_tiles.py, tl_forward.py and tl_backward.py; block_lists.py
(block-sparse masks' tile lists) and decode.py (KV-cache decoding).
"""
