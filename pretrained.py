"""OpenAI's GPT-2 weights in GPT (model.py): GPT.from_pretrained comes from PretrainedMixin.

    model = GPT.from_pretrained("gpt2")                     # through transformers, from the Hugging Face Hub
    model = GPT.from_pretrained("ckpt/model.safetensors")   # a local HF-layout state dict, config.json beside it

GPT's module names follow Hugging Face's GPT-2, so a state dict loads 1:1 but for Conv1D's transposed weights
(see load_hf_state_dict).
"""
import json
from pathlib import Path

import torch
import torch.nn as nn

# OpenAI's four GPT-2 sizes by their Hugging Face names, which GPTConfig.preset builds untrained too; every size
# uses a head size of 64, only the depth and width change
PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}
PRESET_ALIASES = {"124M": "gpt2", "350M": "gpt2-medium", "774M": "gpt2-large", "1.5B": "gpt2-xl"}


class PretrainedMixin:
    """from_pretrained for model.GPT, which names its config class (model.GPTConfig) as config_class."""

    config_class: type

    @classmethod
    def from_pretrained(cls, name_or_path: str, attn: str = "sdpa", n_head: int | None = None, **settings):
        """OpenAI's GPT-2 weights by name (gpt2, gpt2-medium, gpt2-large, gpt2-xl or 124M ... 1.5B,
        through transformers), or a local HF-layout state dict (.safetensors, .bin, .pt). No weight shape reveals
        a local file's n_head: it comes from the config.json beside it (as save_pretrained writes) or from
        n_head=, and without either the load is refused rather than guessed. settings: GPTConfig's window and
        attn_options, to run the dense weights with sparse attention (fine-tuning, say)."""
        name, path = PRESET_ALIASES.get(str(name_or_path), str(name_or_path)), Path(name_or_path)
        if name in PRESETS:
            state_dict, n_head = _download_hf_state_dict(name), PRESETS[name]["n_head"]
        elif path.is_file():
            state_dict = _read_state_dict_file(path)
            n_head = n_head or _n_head_beside(path)
        else:
            raise ValueError(f"{name_or_path!r} is neither a GPT-2 name ({', '.join([*PRESETS, *PRESET_ALIASES])}) "
                             "nor an existing state dict file")
        state_dict = _with_transformer_prefix(state_dict)
        if "transformer.wte.weight" not in state_dict or "transformer.wpe.weight" not in state_dict:
            raise ValueError(f"{name_or_path} holds no GPT-2 token and position embeddings (transformer.wte.weight, "
                             "transformer.wpe.weight); pass a GPT-2 state dict in Hugging Face's layout")
        vocab_size, n_embd = state_dict["transformer.wte.weight"].shape
        n_layer = len({k.split(".")[2] for k in state_dict if k.startswith("transformer.h.")})
        config = cls.config_class(block_size=state_dict["transformer.wpe.weight"].shape[0], vocab_size=vocab_size,
                                  n_layer=n_layer, n_head=n_head, n_embd=n_embd, attn=attn, **settings)
        model = cls(config)
        load_hf_state_dict(model, state_dict)
        return model


def _n_head_beside(path: Path) -> int:
    """n_head from the HF config.json beside a weights file; refused without one (a guess from the head size
    would load a 4-head model as 2 heads without a word)."""
    config_file = path.parent / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json beside it, and n_head cannot be read off the weights; put the "
                         "checkpoint's HF config.json beside it or pass n_head= (GPT.from_pretrained(path, n_head=12))")
    try:
        config = json.loads(config_file.read_text())
        n_head = config.get("n_head", config.get("num_attention_heads"))
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise ValueError(f"{config_file} is not a JSON config ({err}); restore it or pass n_head=") from None
    if not isinstance(n_head, int) or n_head < 1:
        raise ValueError(f"{config_file} gives no n_head (got {n_head!r}); fix it or pass n_head=")
    return n_head


# HF's GPT-2 uses Conv1D layers, which store weights as (in, out); nn.Linear stores (out, in)
_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# non-trainable buffers in older HF checkpoints (a causal mask and its fill value): nothing to load
_HF_BUFFERS = (".attn.bias", ".attn.masked_bias")


def _with_transformer_prefix(state_dict: dict) -> dict:
    """GPT2Model checkpoints (as OpenAI's original upload) name keys h.0..., GPT2LMHeadModel's transformer.h.0..."""
    return {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in state_dict.items()}


def load_hf_state_dict(model: nn.Module, state_dict: dict) -> None:
    """Copy a Hugging Face GPT-2 state dict into a GPT in place (shapes and names must match)."""
    state_dict = {k: v for k, v in _with_transformer_prefix(state_dict).items() if not k.endswith(_HF_BUFFERS)}
    state_dict.pop("lm_head.weight", None)  # tied to wte (save_pretrained often leaves it out)
    ours = model.state_dict()
    expected = set(ours) - {"lm_head.weight"}
    missing, unexpected = expected - set(state_dict), set(state_dict) - expected
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {sorted(missing)[:5]}, unexpected "
                         f"{sorted(unexpected)[:5]}; HF GPT-2 weights need bias=True and the checkpoint's n_layer")
    weights = {key: weight.t() if key.endswith(_CONV1D_WEIGHTS) else weight for key, weight in state_dict.items()}
    for key, weight in weights.items():  # every shape checked before the first copy: no half-loaded model
        if weight.shape != ours[key].shape:
            raise ValueError(f"{key}: checkpoint shape {tuple(weight.shape)} != model shape "
                             f"{tuple(ours[key].shape)}; build the model with the checkpoint's sizes (OpenAI's "
                             "GPT-2 uses vocab_size=50257 and block_size=1024)")
    with torch.no_grad():
        for key, weight in weights.items():
            ours[key].copy_(weight)


def _download_hf_state_dict(name: str) -> dict:
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise ImportError(f"loading {name!r} by name needs transformers: pip install transformers") from None
    try:
        return GPT2LMHeadModel.from_pretrained(name).state_dict()
    except OSError as e:
        raise OSError(f"could not fetch {name!r} from the Hugging Face Hub ({e}); when offline, download it "
                      "elsewhere and pass the path of its model.safetensors or pytorch_model.bin instead") from e


def _read_state_dict_file(path: Path) -> dict:
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ImportError(f"reading {path} needs the safetensors package: pip install safetensors") from None
        return load_file(path)
    if path.suffix in (".bin", ".pt", ".pth"):
        return torch.load(path, map_location="cpu", weights_only=True)
    raise ValueError(f"unsupported weights file {path}; expected .safetensors, .bin, .pt or .pth")
