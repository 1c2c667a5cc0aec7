"""Where a run's numbers go: {out_dir}/metrics.jsonl (one JSON object per line, the format the
benchmarks parse), Weights & Biases, and the console."""
import html
import json
import netrc
import os
from dataclasses import asdict
from urllib.parse import urlparse

import torch

# Dense (no sparsity) bf16 tensor-core peak in FLOP/s, matched as a substring of the lower-cased
# torch.cuda.get_device_name(); the first match wins, so a name that contains another comes first.
PEAK_BF16_FLOPS = [
    ("h100 pcie", 756e12), ("h100 nvl", 835e12), ("h100", 989e12), ("h200", 989e12), ("b200", 2250e12),
    ("a100", 312e12), ("l40s", 362e12), ("l40", 181e12), ("l4", 121e12), ("a10g", 70e12), ("a10", 125e12),
    ("a6000", 155e12), ("4090", 165e12), ("3090", 71e12),
]


def peak_flops(device: torch.device) -> float | None:
    """The GPU's bf16 peak, or None (CPU, or a GPU missing from the table) so MFU goes unreported
    rather than wrong."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def wandb_has_api_key() -> bool:
    """True when wandb could reach its server: WANDB_API_KEY is set, or `wandb login` left a key in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def format_step(record: dict, max_steps: int) -> str:
    loss, norm = (f"{record[key]:{spec}}" if record[key] is not None else "nan"  # null: not finite
                  for key, spec in (("train_loss", ".4f"), ("grad_norm", ".3f")))
    line = (f"step {record['step']:>{len(str(max_steps))}}/{max_steps} | loss {loss} | "
            f"lr {record['lr']:.2e} | norm {norm} | {record['step_ms']:.1f} ms | "
            f"{record['tokens_per_s']:,.0f} tok/s")
    if record["mfu"] is not None:
        line += f" | mfu {100 * record['mfu']:.1f}%"
    if record["peak_mem_gb"] is not None:
        line += f" | mem {record['peak_mem_gb']:.1f} GB"
    return line


def format_skipped(step: int, loss: float, grad_norm: float, skipped: int, in_a_row: int, cfg) -> str:
    limit = "stops now" if cfg.nonfinite == "stop" else f"stops at {cfg.max_skipped_steps}"
    return (f"step {step:>{len(str(cfg.max_steps))}}/{cfg.max_steps} | skipped: loss {loss:.4f} | norm {grad_norm:.3f} "
            f"| no update; {skipped} skipped in all, {in_a_row} in a row ({limit})")


def run_name(cfg, n_params: int | None) -> str:
    """wandb_run_name, or {name}-{parameters}-{attention}: what ran, at a glance (smoke_cpu-3.32M-sdpa)."""
    size = f"-{n_params / 1e6:.3g}M" if n_params else ""
    return cfg.wandb_run_name or f"{cfg.name}{size}-{cfg.attention_label}"


class RunLogger:
    """Rank 0's record of a run. A fresh run starts metrics.jsonl anew; a resumed one keeps the
    records before the checkpoint's step and drops later ones, which the crashed run wrote after its
    last save and the resumed run will write again, so the file always holds one unbroken curve."""

    def __init__(self, cfg, start_step: int, wandb_run_id: str | None, n_params: int | None = None):
        os.makedirs(cfg.out_dir, exist_ok=True)
        self.metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
        kept = self._records_before(start_step) if cfg.resume else []
        self.metrics = open(self.metrics_path, "w")
        self.metrics.writelines(kept)
        self.metrics.flush()
        samples_path = os.path.join(cfg.out_dir, "samples.txt")
        self.samples = open(samples_path, "a" if cfg.resume else "w") if cfg.sample_interval else None
        if not cfg.resume and not cfg.sample_interval and os.path.exists(samples_path):
            os.remove(samples_path)  # an earlier run's samples must not pass for this one's
        self.wandb_run = self._start_wandb(cfg, wandb_run_id, n_params) if cfg.wandb else None

    def _records_before(self, step: int) -> list[str]:
        kept = []
        if os.path.isfile(self.metrics_path):
            with open(self.metrics_path) as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:  # blank, or cut off by the crash
                        continue
                    if record["step"] < step:
                        kept.append(json.dumps(record) + "\n")
        return kept

    @staticmethod
    def _start_wandb(cfg, run_id: str | None, n_params: int | None):
        import wandb

        # wandb.init asks for a key interactively (or fails) without one; offline it logs to disk
        mode = None if wandb_has_api_key() or "WANDB_MODE" in os.environ else "offline"
        if mode == "offline":
            print(f"wandb: no API key found (WANDB_API_KEY or `wandb login`), logging offline under "
                  f"{cfg.out_dir}/wandb; upload later with `wandb sync {cfg.out_dir}/wandb/offline-run-*`")
        # reusing the checkpoint's run id makes a resumed run continue the same wandb curves
        return wandb.init(project=cfg.wandb_project, group=cfg.wandb_group or cfg.name, name=run_name(cfg, n_params),
                          config=asdict(cfg), dir=cfg.out_dir, id=run_id, resume="allow" if run_id else None,
                          mode=mode)

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run else None

    def _write(self, record: dict) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()  # a crash must not eat the lines before it

    def log_train(self, record: dict) -> None:
        """record: step, train_loss, lr, grad_norm, step_ms, tokens_per_s, mfu, peak_mem_gb, attn, warmup, skipped
        (no update: a non-finite loss or gradient norm), skipped_steps (so far)."""
        self._write(record)
        if self.wandb_run:
            names = {"train_loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                     "skipped_steps": "train/skipped_steps", "step_ms": "perf/step_ms",
                     "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "peak_mem_gb": "perf/peak_mem_gb"}
            self.wandb_run.log({name: record[key] for key, name in names.items() if record[key] is not None},
                               step=record["step"])

    def log_val(self, step: int, val_loss: float, attn: str) -> None:
        self._write({"step": step, "val_loss": val_loss, "attn": attn})
        if self.wandb_run:
            self.wandb_run.log({"val/loss": val_loss}, step=step)

    def log_sample(self, step: int, text: str) -> None:
        self.samples.write(f"--- step {step} ---\n{text}\n")
        self.samples.flush()
        if self.wandb_run:
            import wandb

            self.wandb_run.log({"sample": wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def close(self) -> None:
        self.metrics.close()
        if self.samples:
            self.samples.close()
        if self.wandb_run:
            self.wandb_run.finish()
