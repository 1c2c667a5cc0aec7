"""train.py refusing what it cannot run, in one line and before anything is written: bad settings and config files,
a batch that does not split over the ranks, the wrong machine (Triton without a GPU or the interpreter, an out_dir
that cannot be written, GPT-2's weights offline), the wrong checkpoint."""
import os
import shutil
import sys
import time
from dataclasses import asdict

import pytest
import torch
from helpers import cli_flags, cpu_env, run_cli, run_main, tiny_argv, tiny_config

import train
from model import GPT
from training.checkpoint import CheckpointError, Checkpoints
from training.config import ConfigError, TrainConfig, parse_args


@pytest.mark.parametrize("argv, message", [
    (["--batchsize=8"], "unknown setting 'batchsize'"),
    (["--batch_size=eight"], "--batch_size takes an int, got 'eight'"),
    (["--learning_rate=fast"], "--learning_rate takes a float"),
    (["--compile=yes"], "--compile takes true/false/1/0"),
    (["--batch_size"], "--batch_size needs a value"),
    (["--attn=flashy"], "unknown attention backend 'flashy'; choose one of: compile, cuda, flex, moba, naive, sdpa, "
                        "triton"),
    (["--init_from=gpt2", "--attn=flashy"], "unknown attention backend 'flashy'; choose one of"),
    (["--attn=moba", "--window=8"], "model: window=8 with attn='moba': that backend takes no masks"),
    (["--window=-1"], "GPTConfig.window must be an int >= 0"),
    (["--attn=moba", "--moba_topk=-1"], "model: moba_topk must be an int >= 0"),
    (["--init_from=gpt2", "--attn=moba", "--moba_block=8"], "model: moba_block must be an int >= 16"),
    (["--batch_size=3", "--block_size=16", "--total_batch_size=100"], "total_batch_size=100 is not a multiple of"),
    (["--n_layer=2", "--n_head=3", "--n_embd=32"], "n_embd=32 is not divisible by n_head=3"),
    (["--model=gpt5"], "unknown preset 'gpt5'"),
    (["--dtype=fp8"], "unknown dtype='fp8'"),
    (["--device=tpu"], "unknown device='tpu'"),
    (["--max_steps=0"], "max_steps must be at least 1"),
    (["--warmup_steps=50", "--max_steps=10"], "warmup_steps=50 is past the end of the decay"),
    (["--min_lr=1e-2", "--learning_rate=1e-3"], "need 0 <= min_lr <= learning_rate"),
    (["--beta2=1.5"], "beta2 must be in [0, 1)"),
    (["--nonfinite=ignore"], "unknown nonfinite='ignore'; choose one of: skip, stop, off"),
    (["--ddp_reduce_dtype=float16"], "unknown ddp_reduce_dtype='float16'; choose one of: float32, bfloat16"),
    (["--ddp_reduce_dtype=bfloat16", "--parallel=fsdp"], "ddp_reduce_dtype is DDP's; --parallel=fsdp"),
    (["--max_skipped_steps=0"], "max_skipped_steps must be at least 1, got 0"),
    (["--tf32=maybe"], "--tf32 takes true/false/1/0"),
    (["configs/no_such_config.py"], "config file 'configs/no_such_config.py' not found"),
    (["batch_size=8"], "'batch_size=8' is neither a config file nor a flag; flags are written --key=value"),
    (["--lr=1e-3"], "unknown setting 'lr' in the flag '--lr=1e-3'; did you mean learning_rate?"),
    (["--n_embed=64"], "unknown setting 'n_embed' in the flag '--n_embed=64'; did you mean n_embd?"),
    (["--epochs=3"], "unknown setting 'epochs' in the flag '--epochs=3'; valid settings: data_dir, name, out_dir"),
])
def test_bad_settings_name_the_problem(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert message in str(err.value)


def test_bad_config_file_names_the_key(tmp_path):
    config = tmp_path / "cfg.py"
    config.write_text("batch_sise = 8\n")
    with pytest.raises(ConfigError, match=rf"unknown setting 'batch_sise' in {config}"):
        parse_args([str(config)])
    config.write_text("batch_size = '8'\n")
    with pytest.raises(ConfigError, match="batch_size must be int, got str '8'"):
        parse_args([str(config)])


def test_wandb_requested_but_missing_says_how_to_turn_it_off(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails as if not installed
    with pytest.raises(ConfigError, match="pip install wandb, or pass --wandb=false"):
        parse_args(["--wandb=true"])
    assert parse_args(["--wandb=false"]).wandb is False


def test_batch_that_does_not_split_over_ranks_is_an_error():
    cfg = TrainConfig(batch_size=4, block_size=16, total_batch_size=2 * 4 * 16)
    assert cfg.grad_accum_steps(1) == 2 and cfg.grad_accum_steps(2) == 1
    with pytest.raises(ConfigError, match=r"batch_size \* block_size \* world_size = 4 \* 16 \* 4 = 256"):
        cfg.grad_accum_steps(4)


@pytest.mark.parametrize("overrides, error, message", [
    (dict(resume=True), CheckpointError, "no checkpoint at .*ckpt.pt; drop --resume to start a new run"),
    (dict(data_dir="/no/such/folder"), ConfigError, "data_dir '/no/such/folder' does not exist"),
    (dict(data_dir="unindexed"), ConfigError, "has no index.json, which the preparation script writes"),
    (dict(vocab_size=50), ConfigError, r"train_000000.npy holds token id 63, and the model's vocabulary has 50"),
    (dict(block_size=16, batch_size=2000), ConfigError, "fewer than one batch needs"),
    (dict(sample_interval=5, sample_prompt="a long prompt"), ConfigError, "holds token ids >= vocab_size=64"),
])
def test_bad_runs_fail_before_training(tmp_path, data_dir, overrides, error, message):
    if overrides.get("data_dir") == "unindexed":  # shards as an older version, or an unfinished preparation, left them
        overrides["data_dir"] = str(tmp_path / "data")
        shutil.copytree(data_dir, overrides["data_dir"], ignore=shutil.ignore_patterns("index.json"))
    with pytest.raises(error, match=message):
        train.train(tiny_config(tmp_path / "run", **{"data_dir": data_dir, **overrides}))
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_cli_prints_the_error_without_a_traceback():
    result = run_cli("train.py", "--attn=flashy", "--device=cpu", timeout=60)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "train.py: error: attn: unknown attention backend 'flashy'; choose one of: compile, cuda, flex, moba, naive, "
        "sdpa, triton"]
    assert "Traceback" not in result.stdout


def test_triton_on_a_cpu_without_the_interpreter_is_refused_before_anything_is_written(tmp_path, data_dir):
    out_dir = tmp_path / "run"
    result = run_cli("train.py", "--attn=triton", *cli_flags(data_dir=data_dir, out_dir=out_dir, wandb=False),
                     env=cpu_env(TRITON_INTERPRET=None), timeout=60)
    assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: --attn=triton: the triton attention kernels run "
                                                   "on a CUDA GPU, and this runs on cpu")
    assert "sdpa" in lines[0] and "TRITON_INTERPRET=1" in lines[0]
    assert not out_dir.exists()


@pytest.mark.parametrize("flags, message", [
    (["--attn=moba", "--block_size=64", "--moba_block=32"],
     "--attn=moba: the triton attention kernels run on a CUDA GPU, and this runs on cpu; use a dense backend such as "
     "sdpa there, or set TRITON_INTERPRET=1"),
    (["--device=cuda"], "device='cuda' but torch sees no CUDA GPU; pass --device=cpu"),
    (["--attn=flex", "--doc_mask=true"], "--attn=flex: FlexAttention computes gradients on a CUDA GPU only, and this "
     "runs on cpu; use sdpa or naive there"),
    (["--attn=cuda"], "--attn=cuda: the cuda attention kernels run on a CUDA GPU, and this runs on cpu; use a dense "
     "backend such as sdpa there"),
])
def test_the_wrong_machine_is_refused_in_one_line(tmp_path, data_dir, monkeypatch, capsys, flags, message):
    # in this process: Triton's interpreter read as off (TRITON_INTERPRET unset), CUDA as missing
    from attention.flash import device

    monkeypatch.setattr(device, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status, out, err = run_main([f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'run'}", "--wandb=false", *flags],
                                capsys)
    lines = err.strip().splitlines()
    assert status == 1 and len(lines) == 1 and lines[0].startswith(f"train.py: error: {message}")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["a file", "under a file", "read-only"])
def test_an_out_dir_that_cannot_be_written_is_refused_in_one_line(tmp_path, data_dir, monkeypatch, capsys, where):
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "locked").mkdir(mode=0o555)
    if os.geteuid() == 0:  # root may write anywhere: let the folder read as read-only, as it does to anyone else
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: path != str(tmp_path / "locked") and access(path, mode))
    out_dir = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "run",
               "read-only": tmp_path / "locked" / "run"}[where]
    status, out, err = run_main(tiny_argv(out_dir, data_dir, max_steps=2), capsys)
    lines = err.strip().splitlines()
    assert status == 1 and len(lines) == 1 and "Traceback" not in out + err
    assert lines[0].startswith(f"train.py: error: out_dir '{out_dir}' cannot be ") and "pass --out_dir=" in lines[0]
    assert (tmp_path / "file").read_text() == "not a folder" and not list((tmp_path / "locked").iterdir())


@pytest.mark.parametrize("flags, offline, message", [
    (["--block_size=2048"], None, "block_size=2048 is longer than the model's context of 1024 positions; pass "
                                  "--block_size=1024 or less"),
    ([], None, "init_from=gpt2: the weights are not in the Hugging Face cache and 127.0.0.1 cannot be reached"),
    ([], "1", "init_from=gpt2: the weights are not in the Hugging Face cache, and HF_HUB_OFFLINE is set; run once "
              "online"),
])
def test_init_from_gpt2_offline_fails_in_one_line_before_any_download(tmp_path, data_dir, flags, offline, message):
    # a Hub that refuses connections, and an empty cache: what a machine without network sees, without its waits
    env = cpu_env(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE=offline)
    start = time.time()
    flags = ["--init_from=gpt2", *cli_flags(data_dir=data_dir, out_dir=tmp_path / "run", wandb=False), *flags]
    result = run_cli("train.py", *flags, env=env, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stdout + result.stderr
    assert lines[0].startswith(f"train.py: error: {message}")
    assert time.time() - start < 60 and not (tmp_path / "hf").exists()  # no retries, nothing fetched


def test_build_model_refuses_a_checkpoint_of_another_model(tmp_path):
    cfg = tiny_config(tmp_path, "unused")
    model = GPT(cfg.gpt_config())
    good = {"model_config": asdict(model.config), "model": model.state_dict()}
    assert train.build_model(cfg, good).config == model.config
    for model_config in ({**good["model_config"], "rotary": True}, {**good["model_config"], "n_head": "two"}, [1, 2]):
        with pytest.raises(ConfigError, match=r"^the checkpoint's model_config does not describe a model of this "
                                              r"version \(.*\); resume it with the version that wrote it"):
            train.build_model(cfg, {**good, "model_config": model_config})
    wider = {**good, "model_config": {**good["model_config"], "n_embd": 64}}
    fewer = {**good, "model": {k: v for k, v in good["model"].items() if k != "lm_head.weight"}}
    for checkpoint, reason in ((wider, "size mismatch for"), (fewer, "Missing key")):
        with pytest.raises(ConfigError, match=rf"^the checkpoint's weights do not fit its own model_config \({reason}.*"
                                              r"\); it was not written by this trainer, or was changed after$"):
            train.build_model(cfg, checkpoint)


def test_a_checkpoint_whose_data_state_does_not_fit_is_refused(tmp_path, data_dir, capsys):
    argv = tiny_argv(tmp_path, data_dir, max_steps=2)
    assert run_main(argv, capsys)[0] == 0
    checkpoints = Checkpoints(str(tmp_path))
    state = checkpoints.load()
    checkpoints.save({**state, "train_loader": {**state["train_loader"], "shard": 5}})  # digest and all
    status, out, err = run_main([*argv, "--max_steps=4", "--resume"], capsys)
    assert status == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("train.py: error: the checkpoint's optimizer or data state does not fit this run (the state "
                          "points at shard 5") and "resume with the settings and data_dir that trained it" in err
