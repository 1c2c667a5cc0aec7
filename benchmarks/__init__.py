"""Benchmarks: the attention kernel sweep (attention.py) and the training comparison (compare.py).
Run them as modules from the repository root, e.g. `python -m benchmarks.attention --quick`."""
