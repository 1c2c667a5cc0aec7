"""Glue between nanoflash's attention/ and other libraries. Each module imports its library, so
attention/ itself keeps depending on torch and triton only."""
