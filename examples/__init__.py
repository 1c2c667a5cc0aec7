"""Other models built on nanoflash's attention: llama.py (a Llama-style decoder) and its trainer train_llama.py."""
