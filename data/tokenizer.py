"""GPT-2 BPE through tiktoken, giving the uint16 token arrays that shards store."""
import numpy as np
import tiktoken

EOT_TOKEN = 50256  # <|endoftext|>: marks the start of each document in the token stream
UINT16_LIMIT = 2**16


def get_encoding() -> tiktoken.Encoding:
    try:
        return tiktoken.get_encoding("gpt2")
    except OSError as err:  # requests' and urllib's network errors are both OSErrors
        raise RuntimeError(
            f"could not load the GPT-2 BPE files for tiktoken ({err}). tiktoken downloads them on first "
            "use: run once with internet access, or set TIKTOKEN_CACHE_DIR to a folder holding the GPT-2 "
            "BPE files (a copy of an online machine's tiktoken cache)"
        ) from err


def to_uint16(tokens) -> np.ndarray:
    """Token ids as uint16, which halves shard size next to int32; every GPT-2 id (< 50257) fits."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= UINT16_LIMIT):
        raise ValueError(
            f"token ids must lie in [0, {UINT16_LIMIT - 1}] to be stored as uint16, got ids in "
            f"[{tokens.min()}, {tokens.max()}]; a vocabulary of more than {UINT16_LIMIT} tokens needs wider shards"
        )
    return tokens.astype(np.uint16)


def encode(text: str) -> np.ndarray:
    """Text -> uint16 tokens. Special-token strings inside the text (a literal "<|endoftext|>") are
    encoded as ordinary text, so the data itself can never forge a document boundary."""
    return to_uint16(get_encoding().encode_ordinary(text))
