"""Glue between the attention package and other libraries. Each module imports its library itself, and
`import attention` (installed: `import nanoflash`) imports none of them, so the package keeps depending on torch
and triton only."""
