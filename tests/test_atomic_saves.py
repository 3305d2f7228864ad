"""Saves the core makes for later -- training checkpoints, collected positions, drafter weights -- are atomic: a save
killed half-way leaves the previous file whole and no temporary file behind (``dflash_core.files``)."""

import pytest
import torch
from conftest import make_draft, make_target

from dflash_core.files import save_atomic
from dflash_core.model import DFlashDraftModel
from dflash_core.training.loop import TrainState, _save_checkpoint, load_checkpoint


class Killed(Exception):
    pass


def _dies_half_way():
    """A writer that puts half a file on disk, then dies (a run killed mid-save)."""
    def write(obj, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise Killed
    return write


def test_save_atomic_keeps_the_old_file_when_a_save_dies(tmp_path, monkeypatch):
    path = tmp_path / "positions.pt"
    save_atomic({"w": torch.arange(3)}, path)
    monkeypatch.setattr(torch, "save", _dies_half_way())
    with pytest.raises(Killed):
        save_atomic({"w": torch.arange(5)}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path)["w"], torch.arange(3))
    assert [p.name for p in tmp_path.iterdir()] == ["positions.pt"]


def test_a_training_checkpoint_killed_mid_save_leaves_the_last_one(tmp_path, monkeypatch):
    draft = make_draft(make_target("llama", dtype=torch.float32))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-3)
    path = tmp_path / "checkpoint.pt"
    _save_checkpoint(path, draft, optimizer, TrainState(step=7))
    monkeypatch.setattr(torch, "save", _dies_half_way())
    with pytest.raises(Killed):
        _save_checkpoint(path, draft, optimizer, TrainState(step=8))
    monkeypatch.undo()
    assert load_checkpoint(path)["state"]["step"] == 7
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # the old code left checkpoint.tmp


def test_save_pretrained_killed_mid_save_keeps_the_old_weights(tmp_path, monkeypatch):
    import safetensors.torch

    draft = make_draft(make_target("llama", dtype=torch.float32))
    draft.save_pretrained(tmp_path / "d")
    monkeypatch.setattr(safetensors.torch, "save_file", _dies_half_way())
    with pytest.raises(Killed):
        draft.save_pretrained(tmp_path / "d")
    monkeypatch.undo()
    back = DFlashDraftModel.from_pretrained(tmp_path / "d", dtype=torch.float32)
    for (name, a), (_, b) in zip(draft.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]
