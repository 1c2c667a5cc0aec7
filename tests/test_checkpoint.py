"""training/checkpoint.py: the digest every checkpoint carries, the newest/previous rotation, and what a resume does
when a checkpoint fails its check. No training here (test_train.py and test_faults.py run train.py)."""
import os
import struct
import zipfile

import pytest
import torch

from training import checkpoint as ckpt
from training.checkpoint import KEYS, CheckpointError, Checkpoints, read_checkpoint, write_checkpoint


def state(step: int, **extra) -> dict:
    """The smallest dict that passes as train.py's checkpoint: every key of KEYS, weights that say their step."""
    base = {key: None for key in KEYS}
    return {**base, "model": {"w": torch.full((4,), float(step))}, "step": step, **extra}


def written(path, step: int = 1, **extra) -> str:
    with open(path, "w+b") as f:
        write_checkpoint(state(step, **extra), f)
    return str(path)


def record_spans(path) -> dict[str, tuple[int, int]]:
    """Each record's name -> (offset of its bytes in the file, their length), from the local headers."""
    spans = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        for info in archive.infolist():
            f.seek(info.header_offset)
            header = f.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            spans[info.filename] = (info.header_offset + 30 + name_len + extra_len, info.compress_size)
    return spans


def rewrite_record(path, suffix: str, change) -> None:
    """Rebuild the archive with the record whose name ends with suffix changed by change(bytes) -> bytes: a valid zip,
    every CRC right, what a tool that edits a checkpoint in place leaves."""
    with zipfile.ZipFile(path) as archive:
        records = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for info, data in records:
            archive.writestr(info, change(data) if info.filename.endswith(suffix) else data)


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def steps(out_dir) -> tuple:
    """(step of ckpt.pt, step of ckpt.prev.pt), None for a missing file."""
    return tuple(read_checkpoint(os.path.join(out_dir, name))["step"] if os.path.exists(os.path.join(out_dir, name))
                 else None for name in (ckpt.NAME, ckpt.PREVIOUS))


# --- the digest ----------------------------------------------------------------------------------------------------

def test_a_written_checkpoint_reads_back_with_its_digest(tmp_path):
    path = written(tmp_path / "c.pt", step=7, extra=[1, 2])
    loaded = read_checkpoint(path)
    assert loaded["step"] == 7 and loaded["extra"] == [1, 2] and torch.equal(loaded["model"]["w"], torch.full((4,), 7.))
    assert ckpt.DIGEST_RECORD not in loaded  # the digest is a record of the archive, not a key of the state
    assert read_checkpoint(path, digest_only=True) is None
    assert any(n.endswith("/" + ckpt.DIGEST_RECORD) for n in zipfile.ZipFile(path).namelist())


def test_a_flipped_byte_in_any_record_fails_the_check(tmp_path):
    path = written(tmp_path / "c.pt")
    good = open(path, "rb").read()
    spans = record_spans(path)
    assert any(name.endswith("/data/0") for name in spans) and any(name.endswith(ckpt.DIGEST_RECORD) for name in spans)
    for name, (offset, length) in spans.items():
        for at in {offset, offset + length // 2, offset + length - 1}:  # first, middle, last byte of the record
            flip_byte(path, at)
            with pytest.raises(CheckpointError, match=rf"^{path} (failed its digest check|is damaged)") as err:
                read_checkpoint(path, digest_only=True)
            assert "\n" not in str(err.value), f"{name} @ {at}: {err.value}"
            open(path, "wb").write(good)
    read_checkpoint(path)  # restored: good again


def test_a_record_changed_with_a_valid_crc_fails_the_digest(tmp_path):
    path = written(tmp_path / "c.pt")
    rewrite_record(path, "/data/0", lambda data: bytes(len(data)))  # other weights, same size, CRC recomputed
    with pytest.raises(CheckpointError, match=rf"^{path} failed its digest check: its bytes changed after it was "
                                              "written$"):
        read_checkpoint(path)


@pytest.mark.parametrize("keep", ["nothing", "1 byte", "100 bytes", "half", "all but 1 byte"])
def test_a_truncated_checkpoint_fails_the_check(tmp_path, keep):
    path = written(tmp_path / "c.pt")
    size = os.path.getsize(path)
    os.truncate(path, {"nothing": 0, "1 byte": 1, "100 bytes": 100, "half": size // 2, "all but 1 byte": size - 1}[keep])
    with pytest.raises(CheckpointError, match=rf"^{path} is damaged or not a checkpoint"):
        read_checkpoint(path)


def test_files_that_are_not_our_checkpoints_are_refused_by_name(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("step 4: loss 2.3\n")
    with pytest.raises(CheckpointError, match=rf"^{text} is damaged or not a checkpoint \(BadZipFile"):
        read_checkpoint(str(text))
    foreign = tmp_path / "other.zip"
    with zipfile.ZipFile(foreign, "w") as archive:
        archive.writestr("archive/data.pkl", b"not ours")
    with pytest.raises(CheckpointError, match=rf"^{foreign} has no digest record: not a checkpoint of this trainer"):
        read_checkpoint(str(foreign))
    plain = tmp_path / "plain.pt"  # torch.save alone: a checkpoint of an older version, or of another program
    torch.save(state(1), plain)
    with pytest.raises(CheckpointError, match="has no digest record"):
        read_checkpoint(str(plain))
    with pytest.raises(CheckpointError, match="is damaged or not a checkpoint"):
        read_checkpoint(str(tmp_path / "missing.pt"))


def test_a_checkpoint_missing_keys_is_refused(tmp_path):
    path = tmp_path / "c.pt"
    with open(path, "w+b") as f:
        write_checkpoint({"model": {}, "step": 3}, f)
    read_checkpoint(str(path), digest_only=True)  # the bytes are as written ...
    with pytest.raises(CheckpointError, match=rf"^{path} is not a checkpoint of train.py \(it lacks model, optimizer"):
        read_checkpoint(str(path))  # ... but it is not train.py's


def test_a_checkpoint_holding_code_does_not_load(tmp_path):
    # the digest holds (we wrote it), but loading would have to unpickle an arbitrary object
    path = written(tmp_path / "c.pt", extra=zipfile.ZipInfo("x"))
    with pytest.raises(CheckpointError, match=rf"^{path} passed its digest check but does not load \(UnpicklingError"):
        read_checkpoint(str(path))


# --- rotation ------------------------------------------------------------------------------------------------------

def test_rotation_keeps_the_newest_and_the_one_before(tmp_path):
    checkpoints = Checkpoints(str(tmp_path))
    expected = {1: (1, None), 2: (2, 1), 3: (3, 2)}
    for step, pair in expected.items():
        checkpoints.save(state(step))
        assert steps(tmp_path) == pair
    assert sorted(os.listdir(tmp_path)) == sorted([ckpt.NAME, ckpt.PREVIOUS])  # no temporary file left
    # a new process (a resume) takes the newest and rotates it on its first save
    resumed = Checkpoints(str(tmp_path))
    assert resumed.load()["step"] == 3
    resumed.save(state(4))
    assert steps(tmp_path) == (4, 3)


def test_a_bad_newest_is_not_rotated_into_the_previous(tmp_path):
    Checkpoints(str(tmp_path)).save(state(1))
    Checkpoints(str(tmp_path)).save(state(2))
    newest = tmp_path / ckpt.NAME
    flip_byte(newest, record_spans(newest)[next(n for n in record_spans(newest) if n.endswith("data/0"))][0])
    later = Checkpoints(str(tmp_path))  # another process: it did not write the newest, so it checks it
    later.save(state(3))
    assert steps(tmp_path) == (3, 1)  # the damaged step 2 is gone, the good step 1 kept
    later.save(state(4))
    assert steps(tmp_path) == (4, 3)


def test_save_removes_stale_temporary_files(tmp_path):
    for stale in (f"{ckpt.NAME}.123.tmp", f"{ckpt.NAME}.{os.getpid()}.tmp"):  # writes that a kill cut short
        (tmp_path / stale).write_bytes(b"half a checkpoint")
    (tmp_path / "notes.tmp").write_text("not ours")
    Checkpoints(str(tmp_path)).save(state(1))
    assert sorted(os.listdir(tmp_path)) == [ckpt.NAME, "notes.tmp"]


def test_a_failed_write_keeps_both_checkpoints(tmp_path, monkeypatch):
    checkpoints = Checkpoints(str(tmp_path))
    checkpoints.save(state(1))
    checkpoints.save(state(2))

    def save_half_then_fail(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", save_half_then_fail)
    with pytest.raises(OSError, match="No space"):
        checkpoints.save(state(3))
    monkeypatch.undo()
    assert steps(tmp_path) == (2, 1)
    assert sorted(os.listdir(tmp_path)) == sorted([ckpt.NAME, ckpt.PREVIOUS])  # the temporary file is gone too


def test_a_kill_between_the_renames_resumes_from_the_one_before(tmp_path):
    # what a SIGKILL in the middle of a rotation leaves: the newest already renamed to the previous, the new one
    # still under its temporary name (written and verified, but not in place)
    checkpoints = Checkpoints(str(tmp_path))
    checkpoints.save(state(1))
    checkpoints.save(state(2))
    os.replace(checkpoints.newest, checkpoints.previous)
    with open(tmp_path / f"{ckpt.NAME}.99999.tmp", "w+b") as f:
        write_checkpoint(state(3), f)
    messages = []
    resumed = Checkpoints(str(tmp_path))
    assert resumed.load(log=messages.append)["step"] == 2
    assert messages == [f"{checkpoints.newest} is missing; resuming from the previous checkpoint "
                        f"{checkpoints.previous} (step 2)"]
    resumed.save(state(3))
    assert steps(tmp_path) == (3, 2) and sorted(os.listdir(tmp_path)) == sorted([ckpt.NAME, ckpt.PREVIOUS])


# --- load: the newest that passes -----------------------------------------------------------------------------------

def two_saved(tmp_path) -> tuple[str, str]:
    checkpoints = Checkpoints(str(tmp_path))
    checkpoints.save(state(1))
    checkpoints.save(state(2))
    return checkpoints.newest, checkpoints.previous


def test_load_takes_the_newest_silently(tmp_path):
    two_saved(tmp_path)
    messages = []
    assert Checkpoints(str(tmp_path)).load(log=messages.append)["step"] == 2 and messages == []


@pytest.mark.parametrize("damage, reason", [
    (lambda p: os.truncate(p, os.path.getsize(p) // 2), "is damaged or not a checkpoint"),
    (lambda p: os.truncate(p, 0), "is damaged or not a checkpoint"),
    (lambda p: flip_byte(p, record_spans(p)[next(n for n in record_spans(p) if n.endswith("data.pkl"))][0] + 5),
     "is damaged or not a checkpoint (BadZipFile: Bad CRC-32"),
    (lambda p: rewrite_record(p, "/data/0", lambda data: data[::-1]), "failed its digest check"),
    (os.unlink, "is missing"),
], ids=["half", "emptied", "flipped_byte", "rewritten_record", "missing"])
def test_load_falls_back_to_the_previous_checkpoint_and_says_so(tmp_path, damage, reason):
    newest, previous = two_saved(tmp_path)
    damage(newest)
    messages = []
    checkpoints = Checkpoints(str(tmp_path))
    assert checkpoints.load(log=messages.append)["step"] == 1
    assert len(messages) == 1 and messages[0].startswith(f"{newest} {reason}")
    assert messages[0].endswith(f"; resuming from the previous checkpoint {previous} (step 1)")
    # the next save does not rotate the damaged newest over the good previous one
    checkpoints.save(state(2))
    assert steps(tmp_path) == (2, 1)


def test_load_with_both_checkpoints_bad_names_both_and_the_way_out(tmp_path):
    newest, previous = two_saved(tmp_path)
    os.truncate(newest, 10)
    (tmp_path / ckpt.PREVIOUS).write_text("not a checkpoint")
    with pytest.raises(CheckpointError) as err:
        Checkpoints(str(tmp_path)).load()
    message = str(err.value)
    assert message.startswith(f"{newest} is damaged or not a checkpoint") and f"; {previous} is damaged" in message
    assert message.endswith("no good checkpoint to resume from: restore one from a backup, or drop --resume to start "
                            "a new run") and "\n" not in message
    os.unlink(newest)
    with pytest.raises(CheckpointError, match=rf"^{newest} is missing; {previous} is damaged"):
        Checkpoints(str(tmp_path)).load()


def test_load_without_any_checkpoint_says_drop_resume(tmp_path):
    with pytest.raises(CheckpointError, match=rf"^no checkpoint at {tmp_path / ckpt.NAME}; drop --resume to start a "
                                              "new run, or point --out_dir at the folder of the run to continue"):
        Checkpoints(str(tmp_path)).load()
    assert isinstance(CheckpointError("x"), ValueError)
