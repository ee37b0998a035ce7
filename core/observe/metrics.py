"""The metrics of each optimizer step, as the engine hands them to the monitors.

Every step gets ``step``, ``lr``, ``loss_scale``, ``grad_norm``, ``skipped``,
``skipped_steps`` and ``step_time`` (wall time since the previous step ended; for the first
step, since its first forward began); a printed step (every ``steps_per_print`` and the
first), and every step when a monitor records every step (``record``), adds the loss,
throughput and memory readings. The throughput keys (``samples_per_sec``,
``avg_samples_per_sec``, ``tokens_per_sec``) are None where the step has no honest rate:
``tokens_per_sec`` where the inputs have no sequence dimension (:func:`sequence_length`),
all three on the first step an engine measures (see the note below). Plugins add their own keys in ``zeroplug_step_end``
(the built-in ``observe`` plugin: the phase times ``phase_*`` and, after the first step,
the memory report).

Note: samples/s and tokens/s are the step's samples (tokens) over ``step_time``, the wall
time between two step ends: it holds everything the loop waited for, the forward and
backward, the data, and the CPU work an overlapped optimizer step does after
``engine.step()`` returned (the next step waits for it before it ends). A timer around a
part of the step (the backward, or ``engine.step()``) would miss that work.

Note: for the same reason the first step measured has no rate: its own overlapped CPU work
ends inside the second step, and nothing before it carries work into it, so its wall time
holds less than one step's work (under CPU offload on 2 CPU ranks, about 2.5x the steady
median's rate). From the second step on, each interval holds the previous step's
deferred work and defers its own: one step's worth. The running average leaves out the
first two steps measured (warm-up)."""
from __future__ import annotations

import time

import torch

from .memory import device_memory, host_rss_bytes


class StepMetrics:
    def __init__(self, device: torch.device):
        self.last_step_end: float | None = None
        self.measured = 0               # steps this engine has measured (a resumed run starts past step 1)
        self.timed = (0, 0.0)           # (steps, seconds) for the running average
        self.loss_sum: torch.Tensor | None = None

    def forward(self) -> None:
        """A training forward begins (the first one starts the first step's wall time)."""
        if self.last_step_end is None:
            self.last_step_end = time.perf_counter()

    def backward(self, loss: torch.Tensor) -> None:
        """A micro-step's loss (detached) joins the window's sum."""
        if self.last_step_end is None:      # a loop that runs its forward outside the engine
            self.last_step_end = time.perf_counter()
        d = loss.detach().float()
        self.loss_sum = d if self.loss_sum is None else self.loss_sum + d

    def step_end(self, engine, norm: float, lr: float, skipped: bool) -> dict:
        now = time.perf_counter()
        dt = now - (self.last_step_end or now)
        self.last_step_end = now
        self.measured += 1
        first = self.measured == 1
        if self.measured > 2:           # warm-up steps stay out of the running average
            n, t = self.timed
            self.timed = (n + 1, t + dt)
        every = engine.config.batch.steps_per_print
        metrics = {"step": engine.global_step, "lr": lr, "loss_scale": engine.precision.loss_scale,
                   "grad_norm": norm, "skipped": skipped, "skipped_steps": engine.skipped_steps,
                   "step_time": dt, "print": engine.global_step % every == 0 or engine.global_step == 1}
        # Note: a monitor that records every step (the CSV file) gets the readings of every
        # step; they cost one read-back of the loss per step, which printed lines alone avoid.
        metrics["record"] = metrics["print"] or any(m.every_step for m in engine.monitors)
        if metrics["record"]:
            loss = self.loss_sum.item() / engine.gradient_accumulation_steps
            batch = engine.train_batch_size
            cur = None if first or dt <= 0 else batch / dt
            n, t = self.timed
            avg = batch * n / t if t > 0 else cur
            tokens = engine.tokens_per_sample
            alloc, peak = device_memory(engine.run.device)
            metrics.update(loss=loss, samples_per_sec=cur, avg_samples_per_sec=avg,
                           tokens_per_sec=cur * tokens if cur is not None and tokens else None,
                           mem_allocated=alloc, max_mem_allocated=peak, host_rss=host_rss_bytes())
        self.loss_sum = None
        return metrics


def sequence_length(batch) -> int | None:
    """Tokens per sample of a model input: dim 1 of the input ids, looking inside a batch passed
    whole (a tuple, list or dict, as Lightning's ``training_step(batch, i)`` gets it). None
    where the input has no sequence dimension that can be told: fewer than 2 dimensions, or
    floating-point values (feature vectors, images, embeddings: dim 1 of those is features or
    channels, not tokens)."""
    if isinstance(batch, dict):
        batch = batch.get("input_ids", next(iter(batch.values()), None))
    elif isinstance(batch, (list, tuple)):
        batch = batch[0] if batch else None
    if not torch.is_tensor(batch) or batch.dim() < 2 or batch.is_floating_point() or batch.is_complex():
        return None
    return int(batch.shape[1])
