"""TrainConfig: every training setting with its default, and the command line that fills it.

    python train.py [config.py ...] [--key=value ...]

A config file is Python that assigns fields (`batch_size = 16`); files and flags apply left to right,
so flags after a file override it. Every value is checked against its field's type here, so a typo
fails in the first second of a run instead of after an hour of training.
"""
import difflib
import importlib.util
import os
from dataclasses import dataclass, fields
from types import ModuleType

from attention import get_backend
from model import GPTConfig


class ConfigError(ValueError):
    """A bad setting; train.py prints it without a traceback."""


@dataclass
class TrainConfig:
    # data and output
    data_dir: str = "data/shakespeare"  # folder of {split}_{index:06d}.npy token shards (python -m data.<name>)
    name: str = "default"  # the run's name: the config file's, unless set; it starts its out_dir and wandb names
    # ckpt.pt, metrics.jsonl, samples.txt and the wandb folder go here; "" means out/{name}-{attention_label}
    # (out/smoke_cpu-sdpa), so that runs of other configs or backends never overwrite each other's records
    out_dir: str = ""
    resume: bool = False  # continue from {out_dir}/ckpt.pt: same weights, optimizer, data position and RNG
    init_from: str = "scratch"  # "scratch", or GPT-2 weights for GPT.from_pretrained (gpt2, 124M, a file...)
    # model (ignored by init_from, which brings its own shape)
    model: str = "gpt2"  # GPTConfig preset: gpt2|124M, gpt2-medium|350M, gpt2-large|774M, gpt2-xl|1.5B
    n_layer: int = 0  # 0 keeps the preset's value; anything else overrides it
    n_head: int = 0
    n_embd: int = 0
    block_size: int = 1024  # context length, and the length T of every training sequence
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64 for faster matmuls
    dropout: float = 0.0
    bias: bool = True
    attn: str = "sdpa"  # attention backend: one of attention.available_backends()
    window: int = 0  # > 0: a causal sliding window, each token sees the `window` before it; 0 = full attention
    doc_mask: bool = False  # attention stays inside documents, each starting at an EOT token (alone or with window)
    # options of the backends that take them (attention.backend_options), passed to the one chosen
    moba_block: int = 512  # attn=moba: keys per block (a multiple of 128 on a GPU); >= block_size is dense causal
    moba_topk: int = 3  # attn=moba: the earlier blocks each query reads besides its own
    # batch: total_batch_size = batch_size * block_size * grad_accum_steps * world_size
    batch_size: int = 16  # micro-batch B per process
    total_batch_size: int = 0  # tokens per optimizer step; 0 means one micro-batch per process (no accumulation)
    # optimizer and learning-rate schedule: linear warmup, then cosine decay to min_lr
    max_steps: int = 1000  # optimizer steps
    learning_rate: float = 6e-4  # the peak, reached at the end of warmup
    min_lr: float = 6e-5
    warmup_steps: int = 100
    lr_decay_steps: int = 0  # the step where the cosine reaches min_lr; 0 means max_steps
    weight_decay: float = 0.1  # on 2-D weights only (see GPT.configure_optimizers)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off (the norm is still logged)
    # a step whose loss or gradient norm is not finite: "skip" it (no update; counted and logged), "stop" the run at
    # once, or "off" (no check: the optimizer steps on whatever came out); skip stops after max_skipped_steps in a row
    nonfinite: str = "skip"
    max_skipped_steps: int = 5
    # evaluation, samples and checkpoints; an interval of 0 turns the periodic action off
    eval_interval: int = 250  # steps between val-loss evaluations (also run at the last step)
    eval_iters: int = 20  # val batches per evaluation, per process
    sample_interval: int = 500  # steps between text samples (also at the last step)
    sample_tokens: int = 64
    sample_prompt: str = "\n"
    checkpoint_interval: int = 500  # also saved at the end and on SIGINT/SIGTERM
    # false: none at the end nor on SIGINT/SIGTERM (timing runs: a large model's takes minutes to gather and write)
    final_checkpoint: bool = True
    # logging
    log_interval: int = 10  # steps between metrics.jsonl/wandb/console records (the progress bar shows every step)
    wandb: bool = True
    wandb_project: str = "nanoflash"
    wandb_group: str = ""  # "" groups the runs by name
    wandb_run_name: str = ""  # "" names the run {name}-{parameters}-{attention_label}: smoke_cpu-3.32M-sdpa
    # system
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    dtype: str = "auto"  # auto (cuda: bfloat16 if supported, else float16; cpu: float32), float32, bfloat16, float16
    compile: bool = False  # torch.compile the model
    # under torchrun: "ddp" replicates the model on every process; "fsdp" shards weights, gradients and optimizer
    # state across them (FSDP2), for models one GPU cannot hold. One process trains the whole model either way
    parallel: str = "ddp"
    dist_timeout: int = 600  # seconds a collective waits for a lost or hung rank before the run exits
    # DDP's gradient buckets: each is all-reduced as soon as the backward has filled it, and torch.compile splits the
    # model's graph at their edges; larger buckets mean fewer graph pieces and all-reduces (docs/perf_notes.md)
    ddp_bucket_mb: int = 100
    # the dtype DDP all-reduces the gradients in: float32 (exact), or bfloat16 (half the bytes on the wire; each
    # summed gradient rounded to bf16, the weights and the optimizer stay float32). Not with --parallel=fsdp
    ddp_reduce_dtype: str = "float32"
    tf32: bool = True  # CUDA float32 matmuls on TF32 tensor cores (faster, ~1e-3 relative error); false: exact fp32
    seed: int = 1337

    def __post_init__(self):
        for f in fields(self):
            setattr(self, f.name, _checked_type(f.name, f.type, getattr(self, f.name)))
        self._check_values()
        self.out_dir = self.out_dir or os.path.join("out", f"{self.name}-{self.attention_label}")

    def _check_values(self):
        positive = ("block_size", "vocab_size", "batch_size", "max_steps", "eval_iters", "log_interval",
                    "sample_tokens", "dist_timeout", "ddp_bucket_mb")
        non_negative = ("n_layer", "n_head", "n_embd", "total_batch_size", "warmup_steps", "lr_decay_steps",
                        "eval_interval", "sample_interval", "checkpoint_interval")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in non_negative + ("weight_decay", "grad_clip", "min_lr"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.learning_rate or self.min_lr > self.learning_rate:
            raise ConfigError(f"need 0 <= min_lr <= learning_rate and learning_rate > 0, "
                              f"got min_lr={self.min_lr}, learning_rate={self.learning_rate}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.warmup_steps > self.decay_steps:
            raise ConfigError(f"warmup_steps={self.warmup_steps} is past the end of the decay at step "
                              f"{self.decay_steps} (lr_decay_steps, or max_steps when it is 0); shorten the warmup")
        self.grad_accum_steps(world_size=1)  # the process count is known at launch, and checked again then
        if self.nonfinite not in ("skip", "stop", "off"):
            raise ConfigError(f"unknown nonfinite={self.nonfinite!r}; choose one of: skip, stop, off")
        if self.max_skipped_steps < 1:
            raise ConfigError(f"max_skipped_steps must be at least 1, got {self.max_skipped_steps}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"unknown dtype={self.dtype!r}; choose one of: auto, float32, bfloat16, float16")
        if self.parallel not in ("ddp", "fsdp"):
            raise ConfigError(f"unknown parallel={self.parallel!r}; choose one of: ddp, fsdp")
        if self.ddp_reduce_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"unknown ddp_reduce_dtype={self.ddp_reduce_dtype!r}; choose one of: float32, bfloat16")
        if self.ddp_reduce_dtype != "float32" and self.parallel == "fsdp":
            raise ConfigError("ddp_reduce_dtype is DDP's; --parallel=fsdp reduce-scatters float32 gradients: leave it at "
                              "float32, or use --parallel=ddp")
        if not (self.device in ("auto", "cpu", "cuda") or _is_cuda_index(self.device)):
            raise ConfigError(f"unknown device={self.device!r}; choose one of: auto, cpu, cuda, cuda:N")
        if self.wandb and importlib.util.find_spec("wandb") is None:
            raise ConfigError("wandb=true but the wandb package is not installed: "
                              "pip install wandb, or pass --wandb=false")
        if self.init_from == "scratch":
            self.gpt_config()  # GPTConfig checks the model shape (n_embd divisible by n_head, ...) and attention
        else:
            attention = self.attention_settings()
            try:  # init_from brings the shape; the attention settings still apply
                GPTConfig(**attention)
            except ValueError as err:
                raise ConfigError(f"model: {err}") from None

    @property
    def attention_label(self) -> str:
        """The attention in a word, for folder and run names: sdpa, triton-window256, flex-docs."""
        return self.attn + (f"-window{self.window}" if self.window else "") + ("-docs" if self.doc_mask else "")

    @property
    def decay_steps(self) -> int:
        return self.lr_decay_steps or self.max_steps

    def attention_settings(self) -> dict:
        """The GPTConfig fields that choose the attention; unlike the shape, they apply to init_from models too.
        The backend's options come from the flags of the same names."""
        try:
            options = get_backend(self.attn).options
        except ValueError as err:
            raise ConfigError(f"attn: {err}") from None
        return {"attn": self.attn, "window": self.window, "doc_mask": self.doc_mask,
                "attn_options": {name: getattr(self, name) for name in options if hasattr(self, name)}}

    def gpt_config(self) -> GPTConfig:
        sizes = {name: getattr(self, name) for name in ("n_layer", "n_head", "n_embd") if getattr(self, name)}
        attention = self.attention_settings()
        try:
            return GPTConfig.preset(self.model, **sizes, block_size=self.block_size, vocab_size=self.vocab_size,
                                    dropout=self.dropout, bias=self.bias, **attention)
        except ValueError as err:
            raise ConfigError(f"model: {err}") from None

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step for each of world_size processes."""
        per_step = self.batch_size * self.block_size * world_size
        if not self.total_batch_size:
            return 1
        if self.total_batch_size % per_step:
            raise ConfigError(
                f"total_batch_size={self.total_batch_size} is not a multiple of batch_size * block_size * "
                f"world_size = {self.batch_size} * {self.block_size} * {world_size} = {per_step}; "
                "change total_batch_size (0 means no accumulation), batch_size or the number of processes")
        return self.total_batch_size // per_step


def _is_cuda_index(device: str) -> bool:
    kind, _, index = device.partition(":")
    return kind == "cuda" and index.isdigit()


def _checked_type(name: str, kind: type, value):
    # bool is an int subclass in Python, so `True` must not pass for an int field (nor 1 for a bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not kind:
        raise ConfigError(f"{name} must be {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _parse_flag_value(name: str, kind: type, text: str):
    if kind is bool:
        if text.lower() in ("true", "1"):
            return True
        if text.lower() in ("false", "0"):
            return False
        raise ConfigError(f"--{name} takes true/false/1/0, got {text!r}")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"--{name} takes {'an' if kind is int else 'a'} {kind.__name__}, got {text!r}") from None


def _field_types() -> dict[str, type]:
    return {f.name: f.type for f in fields(TrainConfig)}


def _unknown_key(key: str, where: str) -> ConfigError:
    names = list(_field_types())
    # an abbreviation by initials (lr -> learning_rate), else the nearest spelling (batch_sise -> batch_size)
    initials = [name for name in names if "".join(word[0] for word in name.split("_")) == key]
    closest = initials or difflib.get_close_matches(key, names, n=1)
    if closest:
        return ConfigError(f"unknown setting {key!r} in {where}; did you mean {' or '.join(closest)}? (every setting: "
                           "docs/training.md)")
    return ConfigError(f"unknown setting {key!r} in {where}; valid settings: {', '.join(names)}")


def read_config_file(path: str) -> dict:
    """The fields a Python config file assigns. Names starting with _ and imported modules are its own helpers."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found; pass an existing .py file such as configs/smoke_cpu.py")
    with open(path) as f:
        source = f.read()
    namespace: dict = {}
    exec(compile(source, path, "exec"), namespace)
    values = {k: v for k, v in namespace.items() if not k.startswith("_") and not isinstance(v, ModuleType)}
    types = _field_types()
    for key in values:
        if key not in types:
            raise _unknown_key(key, path)
    return values


def parse_args(argv: list[str]) -> TrainConfig:
    """TrainConfig from config files and --key=value flags, applied in the order given."""
    types = _field_types()
    values, config_name = {}, {}
    for arg in argv:
        if not arg.startswith("--"):
            if "=" in arg and not os.path.isfile(arg):
                raise ConfigError(f"{arg!r} is neither a config file nor a flag; flags are written --key=value")
            values.update(read_config_file(arg))
            config_name = {"name": os.path.splitext(os.path.basename(arg))[0]}  # the last file's, as its settings win
            continue
        key, has_value, text = arg[2:].partition("=")
        if key not in types:
            raise _unknown_key(key, f"the flag {arg!r}")
        if not has_value:
            if types[key] is not bool:
                raise ConfigError(f"--{key} needs a value: --{key}=VALUE")
            text = "true"  # a bare --compile means --compile=true
        values[key] = _parse_flag_value(key, types[key], text)
    return TrainConfig(**{**config_name, **values})
