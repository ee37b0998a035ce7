"""Learning-rate schedules against DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py).

``lr_at(t)`` is DeepSpeed's ``get_lr()`` with ``last_batch_iteration = t``; after ``n``
optimizer steps taken, ``engine.get_lr()`` is ``lr_at(n - 1)`` (as DeepSpeed's engine,
which steps the scheduler after each optimizer step).
"""
from __future__ import annotations

import math

import pytest
import torch

import zeroplug
from zeroplug.config import load
from tests.support.toy import ToyNet, batches


# --- DeepSpeed's formulas, by hand ---------------------------------------------------------

def ds_gamma_warmup(t, w, kind):
    w = max(2, w)
    if t < w:
        return math.log(t + 1) / math.log(w) if kind == "log" else t / w
    return 1.0


def ds_warmup(t, lo, hi, w, kind):                       # WarmupLR
    return lo + (hi - lo) * ds_gamma_warmup(t, w, kind)


def ds_warmup_decay(t, lo, hi, w, total, kind):          # WarmupDecayLR
    we = max(2, w)
    if t < we:
        g = ds_gamma_warmup(t, w, kind)
    else:
        g = max(0.0, (total - t) / max(1.0, total - we))
    return lo + (hi - lo) * g


def ds_warmup_cosine(t, lr, total, w, wmin, cmin, kind):  # WarmupCosineLR
    we = max(2, w)
    if t < we:
        r = math.log(t + 1) / math.log(we) if kind == "log" else t / we
        return lr * (wmin + r * (1 - wmin))
    real_last, real_total = t - we + 1, total - we
    r = (1 + math.cos(math.pi * real_last / real_total)) / 2
    return lr * max(0.0, cmin + (1 - cmin) * r)


def schedule(table, lr=0.1):
    choice = load({"scheduler": table, "optimizer": {"lr": lr}}).slot("scheduler")
    return choice.impl(choice.options, None, lr)


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


# --- warmup ----------------------------------------------------------------------------------

def test_warmup_log_key_values():
    s = schedule({"plugin": "warmup", "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 100})
    assert s.lr_at(0) == 0.0
    assert close(s.lr_at(1), 0.01 * math.log(2) / math.log(100))
    assert close(s.lr_at(9), 0.01 * math.log(10) / math.log(100))        # = 0.005 exactly
    assert close(s.lr_at(9), 0.005)
    assert close(s.lr_at(99), 0.01)                                       # log(100)/log(100)
    assert s.lr_at(100) == 0.01 and s.lr_at(10_000) == 0.01


def test_warmup_linear_key_values():
    s = schedule({"plugin": "warmup", "warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
                  "warmup_type": "linear"})
    assert close(s.lr_at(0), 1e-4)
    assert close(s.lr_at(5), 1e-4 + 0.9e-3 * 0.5)
    assert close(s.lr_at(9), 1e-4 + 0.9e-3 * 0.9)
    assert close(s.lr_at(10), 1e-3) and close(s.lr_at(50), 1e-3)


def test_warmup_max_lr_auto_is_optimizer_lr():
    s = schedule({"plugin": "warmup", "warmup_num_steps": 4, "warmup_type": "linear"}, lr=0.2)
    assert [round(s.lr_at(t), 12) for t in range(6)] == [0.0, 0.05, 0.1, 0.15, 0.2, 0.2]


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("w", [1, 2, 3, 7, 50])
def test_warmup_matches_deepspeed(kind, w):
    s = schedule({"plugin": "warmup", "warmup_min_lr": 0.001, "warmup_max_lr": 0.03, "warmup_num_steps": w,
                  "warmup_type": kind})
    for t in range(0, 2 * w + 5):
        assert close(s.lr_at(t), ds_warmup(t, 0.001, 0.03, w, kind)), (t, s.lr_at(t))


def test_warmup_one_step_is_two_as_in_deepspeed():
    s = schedule({"plugin": "warmup", "warmup_max_lr": 1.0, "warmup_num_steps": 1, "warmup_type": "linear"})
    assert [s.lr_at(t) for t in range(4)] == [0.0, 0.5, 1.0, 1.0]


# --- warmup_decay ---------------------------------------------------------------------------

def test_warmup_decay_key_values():
    s = schedule({"plugin": "warmup_decay", "warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                  "warmup_num_steps": 10, "total_num_steps": 110, "warmup_type": "linear"})
    assert s.lr_at(0) == 0.0
    assert close(s.lr_at(5), 0.005)
    assert close(s.lr_at(10), 0.01)                   # (110 - 10) / 100
    assert close(s.lr_at(60), 0.005)                  # halfway down
    assert close(s.lr_at(100), 0.001)
    assert s.lr_at(110) == 0.0 and s.lr_at(500) == 0.0


def test_warmup_decay_decays_to_min_lr():
    """DeepSpeed: lr = min + (max - min) * gamma, so the decay ends at warmup_min_lr, not 0."""
    s = schedule({"plugin": "warmup_decay", "warmup_min_lr": 0.002, "warmup_max_lr": 0.01,
                  "warmup_num_steps": 10, "total_num_steps": 50, "warmup_type": "linear"})
    assert close(s.lr_at(30), 0.002 + 0.008 * 0.5)
    assert close(s.lr_at(50), 0.002) and close(s.lr_at(80), 0.002)


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("w,total", [(1, 1), (1, 10), (5, 5), (5, 20), (30, 100)])
def test_warmup_decay_matches_deepspeed(kind, w, total):
    s = schedule({"plugin": "warmup_decay", "warmup_min_lr": 1e-4, "warmup_max_lr": 0.02,
                  "warmup_num_steps": w, "total_num_steps": total, "warmup_type": kind})
    for t in range(0, total + 10):
        assert close(s.lr_at(t), ds_warmup_decay(t, 1e-4, 0.02, w, total, kind)), (t, s.lr_at(t))


# --- warmup_cosine ---------------------------------------------------------------------------

def test_warmup_cosine_key_values():
    lr = 0.1
    s = schedule({"plugin": "warmup_cosine", "warmup_num_steps": 10, "total_num_steps": 110,
                  "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01, "warmup_type": "linear"}, lr=lr)
    assert close(s.lr_at(0), lr * 0.1)
    assert close(s.lr_at(5), lr * (0.1 + 0.5 * 0.9))
    # the first cosine step already counts as 1 of 100 (DeepSpeed's real_last_step)
    assert close(s.lr_at(10), lr * (0.01 + 0.99 * (1 + math.cos(math.pi * 1 / 100)) / 2))
    assert close(s.lr_at(59), lr * (0.01 + 0.99 * 0.5))          # halfway: cos(pi/2) = 0
    assert close(s.lr_at(109), lr * 0.01)                         # the end: cos_min_ratio
    assert close(s.lr_at(500), lr * 0.01)                         # stays there (DeepSpeed would rise again)


def test_warmup_cosine_log_warmup():
    s = schedule({"plugin": "warmup_cosine", "warmup_num_steps": 8, "total_num_steps": 40}, lr=1.0)
    assert s.lr_at(0) == 0.0
    assert close(s.lr_at(3), math.log(4) / math.log(8))
    assert close(s.lr_at(7), 1.0)


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("w,total", [(0, 10), (1, 10), (4, 12), (25, 200)])
def test_warmup_cosine_matches_deepspeed(kind, w, total):
    s = schedule({"plugin": "warmup_cosine", "warmup_num_steps": w, "total_num_steps": total,
                  "warmup_min_ratio": 0.05, "cos_min_ratio": 0.001, "warmup_type": kind}, lr=3e-4)
    for t in range(0, total):          # DeepSpeed's cosine is periodic past total; ours holds the floor
        assert close(s.lr_at(t), ds_warmup_cosine(t, 3e-4, total, w, 0.05, 0.001, kind)), (t, s.lr_at(t))


def test_none_is_constant():
    s = schedule({"plugin": "none"}, lr=0.07)
    assert [s.lr_at(t) for t in (0, 1, 100)] == [0.07, 0.07, 0.07]


# --- through the engine ----------------------------------------------------------------------

def run_engine(sched, steps, lr=0.1, precision=None, overflow_at=()):
    torch.manual_seed(0)
    cfg = {"batch": {"micro_batch_size": 2}, "optimizer": {"plugin": "sgd", "lr": lr},
           "scheduler": sched, "monitor": {"plugin": "none"}}
    if precision:
        cfg["precision"] = precision
    engine = zeroplug.initialize(ToyNet(), cfg, device="cpu")
    seen = [engine.get_lr()[0]]
    used = []
    for i, (x, y) in enumerate(batches(steps, 2)):
        loss = engine(x, y)
        engine.backward(loss * float("inf") if i in overflow_at else loss)
        engine.step()
        seen.append(engine.get_lr()[0])
        used.append(engine.last_metrics["lr"])
    engine.close()
    return engine, seen, used


def test_engine_warmup_linear():
    engine, seen, used = run_engine({"plugin": "warmup", "warmup_num_steps": 4, "warmup_type": "linear",
                                     "warmup_min_lr": 0.0, "warmup_max_lr": 0.04}, 6)
    expect = [ds_warmup(t, 0.0, 0.04, 4, "linear") for t in range(6)]
    assert seen[0] == expect[0]                        # before any step: lr_at(0)
    for n in range(1, 7):                              # after n steps: DeepSpeed's get_lr() = lr_at(n - 1)
        assert close(seen[n], expect[n - 1]), (n, seen)
    assert [round(v, 12) for v in used] == [round(v, 12) for v in expect]
    assert engine.lr_step == 6


def test_engine_warmup_decay_and_cosine():
    _, seen, _ = run_engine({"plugin": "warmup_decay", "warmup_num_steps": 2, "total_num_steps": 6,
                             "warmup_type": "linear", "warmup_min_lr": 0.01, "warmup_max_lr": 0.05}, 7)
    for n in range(1, 8):
        assert close(seen[n], ds_warmup_decay(n - 1, 0.01, 0.05, 2, 6, "linear")), (n, seen)
    assert close(seen[-1], 0.01)
    _, seen, _ = run_engine({"plugin": "warmup_cosine", "warmup_num_steps": 3, "total_num_steps": 8,
                             "warmup_min_ratio": 0.1, "cos_min_ratio": 0.0}, 6, lr=0.2)
    for n in range(1, 7):
        assert close(seen[n], ds_warmup_cosine(n - 1, 0.2, 8, 3, 0.1, 0.0, "log")), (n, seen)


def test_engine_skipped_step_does_not_advance_schedule():
    engine, seen, used = run_engine({"plugin": "warmup", "warmup_num_steps": 4, "warmup_type": "linear",
                                     "warmup_max_lr": 0.04}, 4,
                                    precision={"plugin": "fp16", "hysteresis": 1, "initial_scale_power": 8},
                                    overflow_at={1})
    assert engine.skipped_steps == 1 and engine.lr_step == 3
    # step 2 was skipped: the lr stays, and steps 3-4 use lr_at(1), lr_at(2)
    assert [round(v, 12) for v in seen] == [0.0, 0.0, 0.0, 0.01, 0.02]
