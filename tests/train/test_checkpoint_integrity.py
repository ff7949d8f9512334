"""What the reliability suite found in checkpointing: a damaged byte in any checkpoint file loaded
silently (now every file is checksummed in state.json, which checks its own content); a failed fsync
was ignored, so a checkpoint could be renamed into place unwritten; a kill during pruning left a
listed checkpoint with files missing; a failed save reached the user as a traceback naming nothing;
a run skipping corrupt samples did not say how many."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
from contextlib import redirect_stderr

import pytest

from tests.reliability.faults import ModuleProxy
from tests.train.test_checkpoint import snap, tiny_model
from tests.train.test_loop import config, tiny  # noqa: F401 - `tiny` is a fixture
from train import checkpoint as ck


@pytest.fixture
def saved(tmp_path):
    model, optimizer = tiny_model()
    return ck.write_checkpoint(tmp_path, snap(model, optimizer, 5))


@pytest.mark.parametrize("name", [ck.MODEL_FILE, ck.OPTIMIZER_FILE, ck.STATE_FILE, ck.DRAFTER_CONFIG_FILE])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_any_damaged_checkpoint_file_is_refused_naming_it(saved, name, damage):
    path = saved / name
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) * 2 // 3] ^= 0x10
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=name):
        ck.load_checkpoint(saved)


def test_a_changed_value_in_state_json_is_refused(saved):
    path = saved / ck.STATE_FILE
    state = json.loads(path.read_text())
    state["step"] = 6  # valid JSON, wrong content
    path.write_text(json.dumps(state, sort_keys=True))
    with pytest.raises(ValueError, match="does not match its checksum"):
        ck.load_checkpoint(saved)


def test_checkpoints_without_checksums_still_load_but_one_key_alone_is_refused(saved):
    path = saved / ck.STATE_FILE
    state = json.loads(path.read_text())
    legacy = {k: v for k, v in state.items() if k not in (ck.FILE_CHECKSUMS_KEY, ck.STATE_CHECKSUM_KEY)}
    path.write_text(json.dumps(legacy))
    assert ck.load_checkpoint(saved)["state"]["step"] == 5
    half = dict(legacy, **{ck.FILE_CHECKSUMS_KEY: state[ck.FILE_CHECKSUMS_KEY]})  # the other key's name was damaged
    path.write_text(json.dumps(half))
    with pytest.raises(ValueError, match=ck.STATE_FILE):
        ck.load_checkpoint(saved)


def test_a_failed_fsync_fails_the_save_naming_the_file(tmp_path, monkeypatch):
    model, optimizer = tiny_model()
    ck.write_checkpoint(tmp_path, snap(model, optimizer, 1))

    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ck, "os", ModuleProxy(os, fsync=failing_fsync))
    with pytest.raises(OSError) as err:
        ck.write_checkpoint(tmp_path, snap(model, optimizer, 2))
    assert err.value.errno == errno.EIO and ".tmp-" in err.value.filename
    monkeypatch.undo()
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


def test_a_kill_while_pruning_never_leaves_a_listed_half_deleted_checkpoint(tmp_path):
    model, optimizer = tiny_model()
    for step in (1, 2):
        ck.write_checkpoint(tmp_path, snap(model, optimizer, step), keep_last=2)
    pid = os.fork()
    if pid == 0:  # child: prune step 1 while saving step 3, and die half-way through deleting it

        def dying_rmtree(path, *args, **kwargs):
            (path / ck.MODEL_FILE).unlink()
            os.kill(os.getpid(), signal.SIGKILL)

        ck.shutil = type("S", (), {"rmtree": staticmethod(dying_rmtree)})
        ck.write_checkpoint(tmp_path, snap(model, optimizer, 3), keep_last=2)
        os._exit(0)  # never reached
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status)
    listed = ck.list_checkpoints(tmp_path)
    assert [s for s, _ in listed] == [2, 3]
    for _, path in listed:
        ck.load_checkpoint(path)
    assert ck.remove_partial_checkpoints(tmp_path)  # the half-deleted one, under its temporary name


def test_a_failed_background_save_names_the_last_complete_checkpoint(tmp_path, monkeypatch):
    model, optimizer = tiny_model()
    writer = ck.CheckpointWriter(tmp_path, keep_last=3)
    writer.save(snap(model, optimizer, 1))
    writer.wait()

    def full_disk(snapshot, directory):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / ck.MODEL_FILE))

    monkeypatch.setattr(ck, "_write_files", full_disk)
    writer.save(snap(model, optimizer, 2))
    with pytest.raises(ck.CheckpointSaveError, match="No space left.*last complete checkpoint is .*step-00000001"):
        writer.wait()


def test_the_train_cli_stops_with_status_4_on_a_full_disk(tiny, tmp_path, monkeypatch):  # noqa: F811
    from train.__main__ import main

    def full_disk(snapshot, directory):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / ck.MODEL_FILE))

    monkeypatch.setattr(ck, "_write_files", full_disk)
    args = [
        f"out_dir={tmp_path / 'runs'}",
        "run_name=r",
        f"data.shards={tiny / 'shards'}",
        "data.token_budget=200",
        "data.holdout_fraction=0",
        "model.num_layers=1",
        "loss.num_anchors=4",
        "optim.max_steps=2",
        "log.progress=false",
    ]
    err = io.StringIO()
    with redirect_stderr(err):
        assert main(args) == 4
    line = [x for x in err.getvalue().splitlines() if x.startswith("train:")][-1]
    assert "No space left on device" in line and ck.MODEL_FILE in line


def test_skipped_corrupt_samples_are_counted_in_the_run_summary(tiny, tmp_path):  # noqa: F811
    import shutil

    from shards import ShardDataset
    from train.loop import train

    shards = tmp_path / "shards"
    shutil.copytree(tiny / "shards", shards)
    entry = ShardDataset(str(shards)).shards[1]
    path = shards / entry["file"]
    path.write_bytes(path.read_bytes()[:-50])  # truncated: the size check catches it even without checksums
    summary = train(
        config(
            tiny, tmp_path, f"data.shards={shards}", "data.on_corrupt=skip", "optim.max_steps=none", "optim.epochs=1"
        )
    )
    assert summary["corrupt_samples"] == {entry["file"]: entry["samples"]}
    clean = train(config(tiny, tmp_path, "run_name=clean", "optim.max_steps=2"))
    assert clean["corrupt_samples"] == {}


class FillingFile:
    """A file on a disk that fills after `room` bytes: the write that crosses it is short, the next raises ENOSPC
    (what a tmpfs does)."""

    def __init__(self, room: int):
        self.room, self.written = room, 0

    def write(self, data) -> int:
        if self.written >= self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = min(len(memoryview(data).cast("B")), self.room - self.written)
        self.written += n
        return n

    def flush(self) -> None:
        pass


def test_a_full_disk_inside_torch_save_is_no_space_left_naming_the_file(tmp_path, monkeypatch):
    """Issue 54: torch's zip writer replaced ENOSPC with "[enforce fail at inline_container.cc:672] unexpected pos";
    the real full disk: tests/reliability/io_errors.py, stage train_optimizer."""
    import torch

    state = {"x": torch.zeros(10_000)}
    with pytest.raises(RuntimeError, match="inline_container"):
        torch.save(state, FillingFile(1000))  # torch's own answer
    with pytest.raises(OSError) as err:
        ck.save_torch(state, FillingFile(1000))
    assert err.value.errno == errno.ENOSPC
    with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device: '.*optimizer\.pt'"):
        ck._writing(tmp_path / ck.OPTIMIZER_FILE, lambda p: ck.save_torch(state, FillingFile(1000)))
