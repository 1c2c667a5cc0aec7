"""Token data for nanoflash: GPT-2 BPE shards on disk and a DDP-aware loader over them.

    python -m data.shakespeare            # tiny shakespeare -> data/shakespeare/{train,val}_000000.npy
    python -m data.fineweb                # FineWeb-Edu sample-10BT -> data/fineweb_edu/
    from data.loader import TokenLoader

Nothing is imported here on purpose: the preparation scripts (and their worker processes) then start
without loading torch, which only the loader needs.
"""
