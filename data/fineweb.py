"""FineWeb-Edu (sample-10BT, about 10B GPT-2 tokens) as token shards. Every document starts with an
EOT token; the stream is cut into shards of --shard_tokens tokens, the first is val, the rest train.

    pip install datasets
    python -m data.fineweb                           # all of it: ~100 shards of 100M tokens (~20 GB)
    python -m data.fineweb --max_tokens 500000000    # stop after the first 500M tokens
"""
import argparse
import itertools
import multiprocessing
import os
import sys
from collections.abc import Iterable, Iterator

import numpy as np

from .shards import find_shards, shard_path, write_index, write_shard
from .tokenizer import EOT_TOKEN, encode

DATASET, SUBSET = "HuggingFaceFW/fineweb-edu", "sample-10BT"
DOCUMENTS_PER_WORKER = 256  # per batch handed to the pool: enough to keep every worker busy


def stream_documents() -> Iterable[str]:
    """The documents' texts, streamed: nothing is downloaded beyond what the tokenizer consumes."""
    try:
        import datasets  # optional dependency: only this script needs it
    except ImportError as err:
        raise ImportError(
            'FineWeb-Edu is streamed with Hugging Face datasets: pip install datasets (or pip install -e ".[fineweb]")'
        ) from err
    try:
        dataset = datasets.load_dataset(DATASET, name=SUBSET, split="train", streaming=True)
    except OSError as err:  # ConnectionError, and the Hub's not-found when offline, are OSErrors
        raise OSError(f"could not open {DATASET} on the Hugging Face Hub ({str(err).splitlines()[0]}); it streams "
                      "from there: run where the Hub can be reached") from None
    return (row["text"] for row in dataset)


def tokenize_document(text: str) -> np.ndarray:
    # EOT *before* each document: the model then always sees a boundary marker before new text starts
    return np.concatenate((np.array([EOT_TOKEN], dtype=np.uint16), encode(text)))


def tokenize_documents(documents: Iterable[str], workers: int = 1) -> Iterator[np.ndarray]:
    """Token arrays in document order, tokenized by `workers` processes."""
    if workers == 1:
        yield from map(tokenize_document, documents)
        return
    documents = iter(documents)
    with multiprocessing.Pool(workers) as pool:  # leaving the block (even early) terminates the workers
        # a batch at a time rather than pool.imap, whose feeder would drain the whole stream into memory
        # and read far past --max_tokens
        while batch := list(itertools.islice(documents, workers * DOCUMENTS_PER_WORKER)):
            yield from pool.map(tokenize_document, batch, chunksize=16)


def group_into_shards(token_arrays: Iterable[np.ndarray], shard_tokens: int,
                      max_tokens: int | None = None) -> Iterator[np.ndarray]:
    """Cut the token stream into shards of exactly shard_tokens tokens, stopping after max_tokens.
    A document that crosses a shard boundary continues in the next shard; the last shard holds the rest."""
    shard, filled, total = np.empty(shard_tokens, dtype=np.uint16), 0, 0
    for tokens in token_arrays:
        if max_tokens is not None:
            tokens = tokens[: max_tokens - total]
        total += len(tokens)
        while len(tokens):
            take = min(len(tokens), shard_tokens - filled)
            shard[filled : filled + take] = tokens[:take]
            filled, tokens = filled + take, tokens[take:]
            if filled == shard_tokens:
                yield shard
                shard, filled = np.empty(shard_tokens, dtype=np.uint16), 0
        if total == max_tokens:
            break
    if filled:
        yield shard[:filled]


def write_shards(documents: Iterable[str], out_dir: str, shard_tokens: int = 10**8,
                 max_tokens: int | None = None, workers: int = 1, made_by: str = "python -m data.fineweb") -> list[str]:
    """Tokenize documents into {out_dir}/val_000000.npy, train_000000.npy, train_000001.npy, ..., then their
    index (made_by: the command that re-creates them). Returns the paths written, val first."""
    for name, value in (("shard_tokens", shard_tokens), ("workers", workers)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens <= shard_tokens):
        raise ValueError(f"max_tokens={max_tokens!r} must be an integer above shard_tokens={shard_tokens}: "
                         "the first shard is val, so fewer tokens would leave no train shard; lower shard_tokens")
    if find_shards(out_dir, "train") or find_shards(out_dir, "val"):
        raise FileExistsError(f"{out_dir} already holds shards; delete them or pick another out_dir, "
                              "so that shards of two runs never mix")
    paths = []
    for i, shard in enumerate(group_into_shards(tokenize_documents(documents, workers), shard_tokens, max_tokens)):
        # the first shard is val: a fixed held-out slice, never trained on
        path = shard_path(out_dir, "val", 0) if i == 0 else shard_path(out_dir, "train", i - 1)
        write_shard(path, shard)
        print(f"{path}: {len(shard):,} tokens")
        paths.append(path)
    write_index(out_dir, made_by)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="data/fineweb_edu", help="where the shards go")
    parser.add_argument("--shard_tokens", type=int, default=10**8, help="tokens per shard")
    parser.add_argument("--max_tokens", type=int, default=None, help="stop after this many tokens in all")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="tokenizer processes (1: tokenize in this process)")
    args = parser.parse_args(argv)
    command = " ".join(["python -m data.fineweb", *(argv if argv is not None else sys.argv[1:])])
    try:
        write_shards(stream_documents(), args.out_dir, args.shard_tokens, args.max_tokens, args.workers, command)
    except (ImportError, OSError, ValueError) as err:  # no datasets, the Hub out of reach, a bad argument
        sys.exit(f"data.fineweb: error: {str(err).splitlines()[0]}")


if __name__ == "__main__":
    main()
