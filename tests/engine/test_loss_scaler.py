"""fp16 loss scaling: DeepSpeed's DynamicLossScaler.update_scale semantics, then through the engine."""
from __future__ import annotations

import itertools
import logging
import math
import random

import pytest
import torch

import zeroplug
from zeroplug.plugins.precision.scaler import LossScaler
from tests.support.toy import ToyNet, batches


O, C = True, False      # overflow, clean


class DeepSpeedReference:
    """DeepSpeed's DynamicLossScaler.update_scale, transcribed (scale_factor 2; at the
    minimum the scale stays floored instead of raising)."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = float(init_scale), 0, -1
        self.scale_window, self.min_scale = scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2
        self.cur_iter += 1


def run(scaler, seq):
    scales, hyst = [], []
    for overflow in seq:
        scaler.update(overflow)
        scales.append(scaler.scale)
        hyst.append(scaler.cur_hysteresis)
    return scales, hyst


S = 2.0 ** 16

# (id, LossScaler kwargs, sequence, expected scale after each step, expected cur_hysteresis or None)
TABLES = [
    ("hysteresis-2-consumed-then-halve", dict(hysteresis=2), [O, O, O],
     [S, S / 2, S / 4], [1, 1, 1]),
    ("hysteresis-1-halves-at-once", dict(hysteresis=1), [O, O], [S / 2, S / 4], [1, 1]),
    ("hysteresis-3", dict(hysteresis=3), [O, O, O, O], [S, S, S / 2, S / 4], [2, 1, 1, 1]),
    ("window-growth", dict(loss_scale_window=3), [C] * 7,
     [S, S, 2 * S, 2 * S, 2 * S, 4 * S, 4 * S], None),
    ("overflow-restarts-window", dict(loss_scale_window=3, hysteresis=1), [C, C, O, C, C, C, C],
     [S, S, S / 2, S / 2, S / 2, S, S], None),
    ("spent-hysteresis-overflow-also-restarts-window", dict(loss_scale_window=3, hysteresis=2),
     [C, C, O, C, C, C], [S, S, S, S, S, 2 * S], [2, 2, 1, 1, 1, 2]),
    ("no-consecutive-hysteresis-clean-step-does-not-refill", dict(hysteresis=2, loss_scale_window=100),
     [O, C, O, C, O], [S, S, S / 2, S / 2, S / 4], [1, 1, 1, 1, 1]),
    ("consecutive-hysteresis-refills-after-clean-step",
     dict(hysteresis=2, loss_scale_window=100, consecutive_hysteresis=True),
     [O, C, O, C, O, O], [S, S, S, S, S, S / 2], [1, 2, 1, 2, 1, 1]),
    ("growth-refills-hysteresis", dict(hysteresis=2, loss_scale_window=2), [O, C, C, O, O],
     [S, S, 2 * S, 2 * S, S], [1, 1, 2, 1, 1]),
    ("min-loss-scale-floor", dict(initial_scale_power=2, hysteresis=1, min_loss_scale=3.0), [O, O, O, C],
     [3.0, 3.0, 3.0, 3.0], None),
    ("min-loss-scale-reached-exactly", dict(initial_scale_power=3, hysteresis=1, min_loss_scale=2.0),
     [O, O, O, O], [4.0, 2.0, 2.0, 2.0], None),
    ("window-1-doubles-every-clean-step", dict(initial_scale_power=0, loss_scale_window=1, hysteresis=1),
     [C, C, O, C], [2.0, 4.0, 2.0, 4.0], None),
    ("static-scale-never-changes", dict(loss_scale=128.0, loss_scale_window=1, hysteresis=1),
     [C, C, O, O, C], [128.0] * 5, None),
]


@pytest.mark.parametrize("kwargs,seq,scales,hyst", [t[1:] for t in TABLES], ids=[t[0] for t in TABLES])
def test_scale_table(kwargs, seq, scales, hyst):
    got_scales, got_hyst = run(LossScaler(**kwargs), seq)
    assert got_scales == scales
    if hyst is not None:
        assert got_hyst == hyst
    if not kwargs.get("loss_scale"):          # the table itself follows DeepSpeed
        ref = DeepSpeedReference(2.0 ** kwargs.get("initial_scale_power", 16), kwargs.get("loss_scale_window", 1000),
                                 kwargs.get("min_loss_scale", 1.0), kwargs.get("hysteresis", 2),
                                 kwargs.get("consecutive_hysteresis", False))
        ref_scales = []
        for overflow in seq:
            ref.update_scale(overflow)
            ref_scales.append(ref.cur_scale)
        assert ref_scales == scales


def test_initial_scale():
    assert LossScaler(initial_scale_power=16).scale == 65536.0
    assert LossScaler(initial_scale_power=0).scale == 1.0
    s = LossScaler(loss_scale=512.0)
    assert s.scale == 512.0 and not s.dynamic


def test_default_window_doubles_after_1000_clean_steps():
    s = LossScaler()
    scales, _ = run(s, [C] * 2000)
    assert scales[998] == S and scales[999] == 2 * S
    assert scales[1998] == 2 * S and scales[1999] == 4 * S


@pytest.mark.parametrize("hysteresis,consecutive,window,min_scale",
                         list(itertools.product([1, 2, 3], [False, True], [1, 2, 5], [1.0, 256.0])))
def test_matches_deepspeed_on_random_sequences(hysteresis, consecutive, window, min_scale):
    rng = random.Random(hysteresis * 1000 + window * 10 + consecutive)
    for _ in range(20):
        p = rng.choice([0.1, 0.3, 0.6])
        seq = [rng.random() < p for _ in range(60)]
        ours = LossScaler(0.0, 10, window, hysteresis, consecutive, min_scale)
        ref = DeepSpeedReference(2.0 ** 10, window, min_scale, hysteresis, consecutive)
        for i, overflow in enumerate(seq):
            ours.update(overflow)
            ref.update_scale(overflow)
            assert ours.scale == ref.cur_scale, (i, seq[:i + 1])
            assert ours.cur_hysteresis == ref.cur_hysteresis, (i, seq[:i + 1])


def test_state_dict_round_trip():
    a = LossScaler(hysteresis=3, loss_scale_window=4)
    run(a, [C, C, O, C, O])
    b = LossScaler(hysteresis=3, loss_scale_window=4)
    b.load_state_dict(a.state_dict())
    seq = [C, C, C, O, O, O, C, C, C, C, C]
    assert run(a, seq) == run(b, seq)
    assert a.overflows == b.overflows == 5


# --- through the engine ----------------------------------------------------------------------

def fp16_engine(**precision):
    torch.manual_seed(0)
    cfg = {"batch": {"micro_batch_size": 4}, "precision": {"plugin": "fp16", **precision},
           "optimizer": {"plugin": "adamw", "lr": 1e-2}, "monitor": {"plugin": "none"}}
    return zeroplug.initialize(ToyNet(), cfg, device="cpu")


def snapshot(engine):
    return ([p.detach().clone() for p in engine.module.parameters()],
            [p.detach().clone() for p in engine.partitioner.master_params()])


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_engine_skips_overflowed_step(caplog):
    caplog.set_level(logging.WARNING, logger="zeroplug")
    engine = fp16_engine(initial_scale_power=8, hysteresis=1)
    assert engine.module.emb.weight.dtype == torch.float16
    data = list(batches(4, 4))

    x, y = data[0]
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    assert engine.skipped_steps == 0 and engine.precision.loss_scale == 256.0
    before = snapshot(engine)

    x, y = data[1]                           # this step overflows
    loss = engine(x, y)
    engine.backward(loss * float("inf"))
    engine.step()
    assert engine.skipped_steps == 1
    assert engine.global_step == 2
    assert engine.lr_step == 1               # the schedule does not advance on a skipped step
    assert engine.precision.loss_scale == 128.0
    assert engine.last_metrics["skipped"] is True
    after = snapshot(engine)
    assert same(before[0], after[0]), "model parameters changed on a skipped step"
    assert same(before[1], after[1]), "master parameters changed on a skipped step"
    lines = [r.getMessage() for r in caplog.records if r.name == "zeroplug"]
    assert any("OVERFLOW! Rank 0 Skipping step 2" in m and "256" in m and "128" in m for m in lines), lines

    for x, y in data[2:]:                    # training goes on
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        assert math.isfinite(loss.item())
    assert engine.skipped_steps == 1 and engine.global_step == 4 and engine.lr_step == 3
    assert engine.last_metrics["skipped"] is False
    final = snapshot(engine)
    assert not same(after[0], final[0]) and not same(after[1], final[1])
    assert all(torch.isfinite(p).all() for p in final[1])
    engine.close()


def test_engine_hysteresis_skips_without_dropping_scale(caplog):
    caplog.set_level(logging.WARNING, logger="zeroplug")
    engine = fp16_engine(initial_scale_power=8, hysteresis=2)
    x, y = next(batches(1, 4))
    for expect_scale in (256.0, 128.0):
        before = snapshot(engine)
        engine.backward(engine(x, y) * float("inf"))
        engine.step()
        assert engine.precision.loss_scale == expect_scale
        assert same(before[1], snapshot(engine)[1])
    assert engine.skipped_steps == 2
    assert sum("OVERFLOW! Rank 0 Skipping step" in r.getMessage() for r in caplog.records) == 2
    engine.close()


def test_engine_huge_initial_scale_backs_off():
    """2**30 overflows fp16 gradients: steps are skipped, the scale halves each time, until it fits."""
    engine = fp16_engine(initial_scale_power=30, hysteresis=1)
    losses = []
    for x, y in batches(40, 4):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.lr_step >= 3:
            break
    k = engine.skipped_steps
    assert k >= 1
    assert engine.precision.loss_scale == 2.0 ** (30 - k)
    assert engine.global_step == k + 3 and engine.lr_step == 3
    assert all(math.isfinite(v) for v in losses)
    engine.close()
