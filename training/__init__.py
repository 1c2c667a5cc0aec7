"""The pieces of train.py that are not the training loop itself: the config and its command line,
checkpoints, DDP plumbing and metric logging. train.py reads top to bottom; these stay out of its way."""
