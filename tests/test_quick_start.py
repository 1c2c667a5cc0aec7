"""The README's quick start as written, on a fresh clone, on the CPU, offline: `python train.py` prepares the data,
picks the CPU's small model and says so, trains, and stops on SIGTERM with a checkpoint. The install command is only
read (installing needs the network), and `python -m pytest` is this very suite."""
import shutil
import signal
import subprocess
import sys
import threading

import pytest
from helpers import ROOT, cpu_env

from training.checkpoint import read_checkpoint

# what a machine without network sees: every proxied request refused at once, the Hugging Face Hub off
OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1",
           "TIKTOKEN_CACHE_DIR": None, "TRITON_INTERPRET": None}


def quick_start_commands() -> list[str]:
    """The commands of the README's first code block under "## Quick start", without their comments."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start"):]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    block = block[:block.index("\n```")]
    return [line.split("#")[0].strip() for line in block.splitlines() if not line.startswith("#")]


def fresh_clone(folder):
    """The files a clone of this checkout would hold: what git tracks, and new files it does not ignore."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"not a git checkout: {err}")
    for name in listed:
        if (ROOT / name).is_file():  # a tracked file deleted in the working tree is not there to copy
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, folder / name)
    return folder


def test_the_readme_quick_start_runs_on_a_fresh_clone_offline(tmp_path):
    install, train, tests = quick_start_commands()
    assert install.startswith("pip install -e ") and "download.pytorch.org/whl/cpu" in install  # the CPU wheels
    assert (train, tests) == ("python train.py", "python -m pytest")
    clone = fresh_clone(tmp_path / "nanoflash")
    assert not (clone / "data" / "shakespeare").exists()

    command = [sys.executable, *train.split()[1:]]
    proc = subprocess.Popen(command, cwd=clone, env=cpu_env(**OFFLINE), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(150, proc.kill)
    watchdog.start()
    lines = []
    for line in proc.stdout:  # once the first step is logged the run has done all there is to check: stop it there
        lines.append(line.rstrip("\n"))
        if line.startswith("step   0/100 |"):
            proc.send_signal(signal.SIGTERM)
    stderr = proc.stderr.read()
    proc.wait()
    watchdog.cancel()
    assert proc.returncode == 0 and stderr == "", "\n".join(lines) + stderr[-3000:]
    assert lines[0].startswith("no config file given: configs/shakespeare_cpu.py (a 4-layer GPT")
    assert lines[1].startswith("first use: prepared tiny shakespeare (train: 304,218 tokens in 6,325 speeches")
    assert lines[2].endswith("records in out/shakespeare_cpu-sdpa") and "attn=sdpa, cpu, torch.float32" in lines[2]
    assert lines[-1].startswith("stopped by SIGTERM at step ")
    assert read_checkpoint(clone / "out" / "shakespeare_cpu-sdpa" / "ckpt.pt")["train_config"]["n_layer"] == 4
