"""The cells tuner_audit.py and head_choices.py share: GPT-2's, then the benchmark grid's (16k tokens per batch)."""
CELLS = [(16, 12, 1024, 64, True)] + [(16384 // T, 2048 // D, T, D, causal) for D in (64, 128)
                                      for causal in (True, False) for T in (1024, 4096, 16384)]
