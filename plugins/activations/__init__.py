"""Where activation checkpointing keeps the checkpointed blocks' inputs until their recompute:
on the device ("none", torch's behaviour) or in host memory ("cpu"), copied out during the
forward and fetched back ahead of the backward on side streams (saved.py)."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

from zeroplug import hookimpl
from zeroplug.options import opt
from zeroplug.slots import ActivationStore

from .saved import HostActivations

log = logging.getLogger("zeroplug")


class OnDevice(ActivationStore):
    """Checkpointed blocks' inputs stay on the device (torch.utils.checkpoint as is)."""


class OnHost(ActivationStore):
    """Checkpointed blocks' inputs wait in (pinned) host memory for their block's recompute."""

    @dataclass(frozen=True)
    class Options:
        pin_memory: bool = opt(
            True, "Page-locked host buffers, so that the copies run asynchronously on side streams and "
                  "overlap the forward and backward (pageable memory makes each copy a wait).")
        buffer_count: int = opt(
            2, "Block inputs in flight at once: copies to the host not yet finished in the forward (past "
               "this many the host waits for the oldest, which bounds the device memory they hold), and "
               "block inputs fetched back ahead of their recompute in the backward.", min=1, max=1024)
        min_offload_bytes: int = opt(
            1 << 20, "Saved block inputs smaller than this stay on the device: each copy has a fixed cost "
                     "(a launch and an event) whatever its size.", min=0)
        device_bytes: int = opt(
            0, "Block inputs of a forward that stay on the device, up to this many bytes (the first ones "
               "saved, which the backward needs last); the rest go to the host. For sequences whose "
               "checkpoints outgrow the host's memory while the device has room left.", min=0)

    def __init__(self, options, run):
        super().__init__(options, run)
        self.store = HostActivations(run.device, options.pin_memory, options.buffer_count,
                                     options.min_offload_bytes, options.device_bytes)
        self._warned = False

    @property
    def stats(self):
        """Counts since initialize: ``offloaded`` (tensors copied out), ``offloaded_bytes``,
        ``kept`` (given back from the device: their copy was still in flight), ``fetched`` (copied
        back at their use), ``prefetched`` (copied back ahead of it), ``kept_on_device`` (left there
        by ``device_bytes``)."""
        return self.store.stats

    def host_bytes(self) -> int:
        return self.store.host_bytes()

    @contextmanager
    def forward_context(self):
        before = self.store.stats["offloaded"]
        with self.store.hooks():
            yield
        if not self._warned:      # the first training forward tells
            self._warned = True
            if self.store.stats["offloaded"] == before:
                log.warning("[zeroplug] activation_checkpointing.plugin = \"cpu\": the forward saved no checkpointed "
                            "block input of %d bytes or more, so nothing left the device; turn activation "
                            "checkpointing on (model.gradient_checkpointing_enable(), or torch.utils.checkpoint "
                            "around each block). A torch.compile'd model saves inside its compiled graph, "
                            "where these hooks see no checkpoint: compile each block instead of the model",
                            self.options.min_offload_bytes)


@hookimpl
def zeroplug_engine_setup(engine):
    """The host store counts its copies against this rank's share of the host memory left
    after the states (the tiers hold theirs by now): zeroplug.host_budget.host_room."""
    store = engine.activations
    if isinstance(store, OnHost):
        from zeroplug.host_budget import host_room
        store.store.room, store.store.room_source = host_room(engine.run)


@hookimpl
def zeroplug_register_activations(register):
    register("none", OnDevice)
    register("cpu", OnHost)
