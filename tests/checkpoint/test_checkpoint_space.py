"""The free-space check before a save counts this save's own bytes.

A first save into an empty directory has no previous checkpoint to size itself by: the
estimate from the states (model-dtype values, fp32 masters, optimizer states) is all the
check has. It must be close to what the save writes, for fp32 and 16-bit models, with
and without an offloaded optimizer.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import zeroplug
from zeroplug.checkpoint import CheckpointError
from zeroplug.checkpoint import directory as checkpoint_dir

from tests.support.toy import ToyNet, batches


def _cfg(precision: str, offload: bool) -> dict:
    c = {"zero": {"plugin": "stage2"}, "batch": {"micro_batch_size": 4},
         "optimizer": {"plugin": "adamw", "lr": 1e-2}, "precision": {"plugin": precision},
         "monitor": {"plugin": "none"}}
    if offload:
        c["offload"] = {"optimizer": {"plugin": "cpu"}}
    return c


def _trained(config):
    torch.manual_seed(0)
    e = zeroplug.initialize(ToyNet(d=64, hidden=256), config)
    for x, y in batches(1, 4):
        e.backward(e(x, y))
        e.step()
    return e


@pytest.mark.parametrize("precision,offload", [("fp32", False), ("fp32", True), ("bf16", False)])
def test_first_save_that_cannot_fit_is_refused(tmp_path, monkeypatch, caplog, precision, offload):
    e = _trained(_cfg(precision, offload))
    with caplog.at_level(logging.WARNING, logger="zeroplug"):
        written = Path(e.save_checkpoint(tmp_path / "real"))
    assert "could not be sized" not in caplog.text
    size = sum(p.stat().st_size for p in written.iterdir())
    # too little room: refused before anything is written, naming the size it needs
    monkeypatch.setattr(checkpoint_dir, "free_bytes", lambda path: size // 2)
    with pytest.raises(CheckpointError, match=r"needs about .* but .* has") as info:
        e.save_checkpoint(tmp_path / "empty")
    assert "no checkpoint was written" in str(info.value)
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == [".zeroplug.lock"]
    # room for what the save writes: the estimate does not overshoot it by much
    monkeypatch.setattr(checkpoint_dir, "free_bytes", lambda path: int(size * 1.25))
    e.save_checkpoint(tmp_path / "roomy")
    e.close()
