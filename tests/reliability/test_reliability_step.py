"""A failed step leaves no half-updated state behind that could be trained on or saved.

An error inside ``engine.step()`` (an exception in the optimizer, ENOSPC / EIO from the
NVMe swapper) at sub-group k leaves sub-groups before k updated and the rest not. The
engine is then marked failed (``engine.run.failed``): forward, backward, step and
``save_checkpoint`` refuse, saying to resume from the last checkpoint, and the checkpoint
directory is untouched. Loading that checkpoint into the same engine rolls it back: the
run goes on bit-identical to one that never failed. Faults are injected at each sub-group
(in the optimizer; and at the swapper's own ``pwritev`` / ``preadv`` calls, with the
errno the disk would give), for the serial offloaded step, the overlapped stage-3 step
(where the error surfaces after ``step()`` returned) and the nvme tier.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from zeroplug.errors import StepFailedError
from zeroplug.plugins.offload_nvme import SwapIOError, SwapSpaceError

from tests.checkpoint.test_checkpoint import CPU, batch, cfg, make, train, train_step

STEPS = 5          # steps 0, 1, checkpoint, step 2 fails, then 2..4 again
OVERLAP = {"zero": {"plugin": "stage3", "reduce_bucket_size": 500, "sub_group_size": 700,
                    "stage3_param_persistence_threshold": 30},
           "optimizer": {"plugin": "cpu_adam", "lr": 1e-2, "weight_decay": 0.01},
           # (parameters offloaded too: on one rank, stage 3 otherwise keeps everything whole)
           "offload": {"optimizer": {"plugin": "cpu", "overlap_step": True}, "param": {"plugin": "cpu"}}}


def configs(tmp_path) -> dict:
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    nvme = {"optimizer": {"plugin": "nvme", "nvme_path": str(swap), "buffer_count": 2, "reuse_resident": False}}
    return {"cpu": cfg(2, offload=CPU),
            "overlap": cfg(3, **{k: v for k, v in OVERLAP.items() if k != "offload"}, offload=OVERLAP["offload"]),
            "nvme": cfg(2, offload=nvme)}


def _dir_state(d: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(d)), p.stat().st_size) for p in d.rglob("*") if p.name != ".zeroplug.lock")


def _check_failed_then_roll_back(e, ck: Path, ref: list[float], fail) -> None:
    """``fail()`` makes step 2 fail; then everything refuses, nothing is written, and a load
    of the checkpoint of step 2 continues exactly as the reference."""
    before = _dir_state(ck)
    fail()
    assert e.run.failed is not None
    x, y = batch(2, 0)
    for call in (lambda: e(x, y), lambda: e.step(), lambda: e.save_checkpoint(ck),
                 lambda: e.save_checkpoint(ck, tag="elsewhere")):
        with pytest.raises(StepFailedError, match="may be half updated.*resume from the last checkpoint"):
            call()
    assert _dir_state(ck) == before and (ck / "latest").read_text() == "global_step2"
    e.load_checkpoint(ck)
    assert e.run.failed is None
    assert train(e, range(2, STEPS)) == ref[2:]


def _prepare(c, ck):
    e = make(c)
    train(e, range(2))
    e.save_checkpoint(ck)
    return e


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    out = {}
    for name, c in configs(tmp_path_factory.mktemp("ref")).items():
        e = make(c)
        out[name] = train(e, range(STEPS))
        e.close()
    return out


# --- an exception in the optimizer, at each sub-group -----------------------------------------

def _fail_at(e, k: int, method: str):
    """The optimizer's ``method`` raises on its k-th call of the next step."""
    real = getattr(e.optimizer, method)
    calls = []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == k + 1:
            raise RuntimeError(f"injected failure at sub-group {k}")
        return real(*a, **kw)
    setattr(e.optimizer, method, flaky)
    return lambda: setattr(e.optimizer, method, real)


def test_optimizer_error_at_each_sub_group(tmp_path, refs):
    c = configs(tmp_path)["cpu"]
    n = len(make(c).partitioner.sub_group_ranges)
    assert n >= 8
    for k in range(n):
        ck = tmp_path / f"k{k}"
        e = _prepare(c, ck)
        undo = _fail_at(e, k, "step")

        def fail():
            with pytest.raises(RuntimeError, match=f"injected failure at sub-group {k}"):
                train_step(e, 2)
            undo()
        _check_failed_then_roll_back(e, ck, refs["cpu"], fail)
        e.close()


def test_overlapped_step_error_at_each_sub_group(tmp_path, refs):
    """The stage-3 step runs on after step() returned: the failure is known where it surfaces
    (the next forward, or a save) and from then on."""
    c = configs(tmp_path)["overlap"]
    n = len(make(c).partitioner.sub_group_ranges)
    assert n >= 5
    for k in range(n):
        ck = tmp_path / f"k{k}"
        e = _prepare(c, ck)
        e.partitioner.wait_optimizer()
        undo = _fail_at(e, k, "step_param")

        def fail():
            train_step(e, 2)                 # returns: the sub-groups step in the background
            assert e.offload_optimizer.overlapped_steps > 0
            if k % 2:                        # surfaces in the next forward ...
                with pytest.raises(RuntimeError, match=f"injected failure at sub-group {k}"):
                    e(*batch(3, 0))
            else:                            # ... or in a save, which then writes nothing
                with pytest.raises(StepFailedError, match=f"injected failure at sub-group {k}"):
                    e.save_checkpoint(ck)
            undo()
        _check_failed_then_roll_back(e, ck, refs["overlap"], fail)
        e.close()


# --- the NVMe swapper: ENOSPC on a write, EIO on a read, at each sub-group ------------------------

def _disk_fault(sw, k: int, write: bool, code: int):
    """The swapper's pwritev (or preadv) fails with ``code`` on the files of sub-group k."""
    attr = "_pwritev" if write else "_preadv"
    real = getattr(sw, attr)

    async def faulty(fd, bufs, offset, *a, **kw):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).split("-", 1)[1].startswith(f"_{k}_"):
            raise OSError(code, os.strerror(code))
        return await real(fd, bufs, offset, *a, **kw)
    setattr(sw, attr, faulty)
    return lambda: setattr(sw, attr, real)


@pytest.mark.parametrize("write,code,error", [(True, errno.ENOSPC, SwapSpaceError), (False, errno.EIO, SwapIOError)])
def test_swapper_error_at_each_sub_group(tmp_path, refs, write, code, error):
    c = configs(tmp_path)["nvme"]
    probe = make(c)
    n = len(probe.partitioner.sub_group_ranges)
    probe.close()
    for k in range(n):
        ck = tmp_path / f"k{k}"
        e = _prepare(c, ck)
        undo = _disk_fault(e.offload_optimizer.swapper, k, write, code)

        def fail():
            with pytest.raises(error, match=rf"_{k}_[a-z_]*\.swp: {errno.errorcode[code]}") as ei:
                train_step(e, 2)
            assert e.offload_optimizer.swapper.path in str(ei.value)
            undo()
        _check_failed_then_roll_back(e, ck, refs["nvme"], fail)
        e.close()
    assert os.listdir(tmp_path / "swap") == []


# --- what is not a failure ----------------------------------------------------------------------

def test_non_finite_gradients_skip_the_step_and_keep_the_state(tmp_path):
    """fp32 with a NaN gradient: the step is skipped (counted), every state stays as it was,
    and a checkpoint of it is a whole one."""
    e = make(cfg(2, offload=CPU))
    train(e, range(2))
    masters = [t.detach().clone() for t in e.partitioner.master_params()]
    x, y = batch(2, 0)
    loss = e(x, y)
    e.backward(loss * float("nan"))
    e.step()
    assert e.skipped_steps == 1 and e.run.failed is None
    assert all(torch.equal(a, b) for a, b in zip(masters, e.partitioner.master_params()))
    e.save_checkpoint(tmp_path)
    e2 = make(cfg(2, offload=CPU), seed=3)
    e2.load_checkpoint(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(masters, e2.partitioner.master_params()))
