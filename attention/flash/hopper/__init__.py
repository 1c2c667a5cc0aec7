"""The Hopper (sm_90) kernels, warp-specialized in Gluon (docs/flash_attention.md §12, §13).

  forward.py, backward.py   host side: whether a call can run here, and its launches
  shapes.py                 the kernels' fixed shapes and their tiles (plain Python: read where Gluon is missing too)
  gluon_forward.py          the forward kernel (§12)
  gluon_backward.py         the backward kernel (§13)
  gluon_common.py           what both share: copies, documents' spans, gathered rows, tensor descriptors

The gluon_* modules are imported only where Gluon exists (device.HAS_GLUON).
"""
