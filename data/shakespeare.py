"""Tiny Shakespeare as GPT-2 tokens: the first 90% for training, the last 10% for validation.

    python -m data.shakespeare                       # downloads the text (1.1 MB)
    python -m data.shakespeare --input input.txt     # offline: a local copy of the text
"""
import argparse
import sys
import urllib.request

from .shards import shard_path, write_index, write_shard
from .tokenizer import encode

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TRAIN_FRACTION = 0.9


def download_text(url: str = URL) -> str:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.read().decode("utf-8")
    except OSError as err:  # URLError, timeouts and refused connections are all OSErrors
        raise RuntimeError(
            f"could not download tiny shakespeare from {url} ({err}); without internet access, "
            "pass --input PATH pointing at a local copy of the text"
        ) from err


def prepare(text: str, out_dir: str, made_by: str = "python -m data.shakespeare") -> dict[str, int]:
    """Tokenize text and write train_000000.npy and val_000000.npy, then their index (made_by: the command that
    re-creates them); returns the token count of each."""
    tokens = encode(text)
    n_train = int(len(tokens) * TRAIN_FRACTION)
    if n_train == 0:
        raise ValueError(f"the text has only {len(tokens)} token(s): too few to split into train and val")
    counts = {}
    # split by position, not at random: val is then text the model has never seen a neighbour of
    for split, part in (("train", tokens[:n_train]), ("val", tokens[n_train:])):
        write_shard(shard_path(out_dir, split, 0), part)
        counts[split] = len(part)
    write_index(out_dir, made_by)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", metavar="PATH", help="read the text from this file instead of downloading it")
    parser.add_argument("--out_dir", default="data/shakespeare", help="where the shards go")
    args = parser.parse_args(argv)

    if args.input:
        with open(args.input, encoding="utf-8") as f:
            text = f.read()
    else:
        text = download_text()
    command = " ".join(["python -m data.shakespeare", *(argv if argv is not None else sys.argv[1:])])
    counts = prepare(text, args.out_dir, command)
    print(f"train: {counts['train']:,} tokens, val: {counts['val']:,} tokens -> {args.out_dir}")


if __name__ == "__main__":
    main()
