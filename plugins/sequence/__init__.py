"""[sequence]: how the ranks share long sequences.

* ``none``: every rank trains whole sequences, computed as the model computes them.
* ``ulysses``: each sequence is sliced over a group of ``sequence_parallel_size`` consecutive
  ranks (DeepSpeed's Ulysses / ALST): attention exchanges heads for sequence with all-to-all
  (exchange.py), the loss is the group's mean over its real tokens (loss.py); and, on any
  group size, the MLP and the language-model head with its loss compute in tiles along the
  sequence (tiles.py), so that neither the MLP's widest temporaries nor the logits exist for
  the whole sequence. ZeRO shards the states over every rank, as DeepSpeed does.

The plugin builds the slot's implementation at the end of ``initialize``
(``zeroplug_engine_setup``) and attaches it to the model (adapters.py: Hugging Face causal LMs
through transformers' attention interface, the reference GPT through its ``attend`` /
``head_loss`` attributes). The data side: :func:`shard_batch`, or ``for_engine(engine).shard``
and ``.loader`` (data.py). Activation checkpoints in pinned host memory are the
``[activation_checkpointing] plugin = "cpu"`` store's.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Literal

import torch

from zeroplug import hookimpl
from zeroplug.errors import ConfigError
from zeroplug.options import AUTO, opt
from zeroplug.slots import SequenceStrategy

from .adapters import KEY, Attached, Tiles, attach_hf, attach_own, is_hf
from .data import ShardedLoader, shard_batch
from .groups import SequenceGroup, sequence_group

__all__ = ["Whole", "Ulysses", "for_engine", "shard_batch", "ShardedLoader", "SequenceGroup"]

log = logging.getLogger("zeroplug")

GiB = 1 << 30


class Whole(SequenceStrategy):
    """Every rank trains whole sequences (nothing sliced or tiled)."""

    def attach(self, engine) -> None:
        self.group = sequence_group(self.run.comm, 1)

    def shard(self, batch: dict) -> dict:
        """The batch as it is (every rank holds its whole sequences)."""
        return batch

    def loader(self, loader):
        return loader


class Ulysses(SequenceStrategy):
    """Sequences sliced over groups of ranks (attention exchanges heads for sequence), and the MLP and the head's loss in tiles along the sequence."""

    @dataclass(frozen=True)
    class Options:
        sequence_parallel_size: int = opt(
            1, "Ranks that share one sequence, each holding a slice of it (consecutive ranks: [0, P), [P, 2P), "
               "...; DeepSpeed's sequence_parallel_size). It must divide the world size and the model's attention "
               "heads; the batch sizes count world size / this many data-parallel ranks. 1: no slicing, tiles "
               "only.", min=1, max=1 << 16, alias=("size",))
        tiled_mlp: bool = opt(
            True, "Compute each block's MLP (modules named `mlp`) in chunks of tokens along the sequence, "
                  "recomputing each chunk in the backward: its widest temporaries exist for one chunk.")
        tiled_loss: bool = opt(
            True, "Compute the language-model head and the cross entropy in chunks of tokens, forward and "
                  "backward (the softmax's gradient written per chunk): the logits [tokens, vocab] never exist "
                  "whole.")
        mlp_chunk_tokens: int | Literal["auto"] = opt(
            AUTO, "Tokens per MLP chunk (batch x sequence slice). \"auto\": as many as fit tile_bytes (6 values of "
                  "the MLP's widest layer per token); a sequence that fits one chunk is not tiled.", min=1)
        loss_chunk_tokens: int | Literal["auto"] = opt(
            AUTO, "Tokens per chunk of the head and loss. \"auto\": as many as fit tile_bytes (fp32 logits, their "
                  "gradient and a model-dtype copy: 8 + 2 bytes x vocabulary per token).", min=1)
        tile_bytes: int | Literal["auto"] = opt(
            AUTO, "Device memory one tile's temporaries may take, which sets the \"auto\" chunk sizes; the chunks' "
                  "parameter gradients are summed in fp32 when they fit it too. \"auto\": a sixteenth of the "
                  "device memory free at initialize, at most 2 GiB (the CPU: 256 MiB); the least over the ranks.",
            min=1 << 16)
        ignore_index: int = opt(-100, "The label that takes no part in the loss (padding, prompts).")

    @classmethod
    def ranks_per_sample(cls, options) -> int:
        return options.sequence_parallel_size

    @classmethod
    def check_config(cls, config, choice) -> None:
        o = choice.options
        if o.sequence_parallel_size == 1 and not (o.tiled_mlp or o.tiled_loss):
            raise ConfigError("[sequence] plugin = \"ulysses\" with sequence_parallel_size = 1 and neither "
                              "tiled_mlp nor tiled_loss does nothing: set one, or plugin = \"none\"", key=KEY)

    def attach(self, engine) -> None:
        o, run = self.options, self.run
        self.group = sequence_group(run.comm, o.sequence_parallel_size)
        model = engine.module
        budget = self._budget()
        tiles = Tiles(0, 0, budget)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        elem = torch.empty((), dtype=dtype).element_size()
        if o.tiled_mlp:
            width = _mlp_width(model)
            tiles.mlp_tokens = (o.mlp_chunk_tokens if o.mlp_chunk_tokens != AUTO
                                else max(1, budget // (6 * width * elem)) if width else 0)
        if o.tiled_loss:
            vocab = _vocab(model)
            tiles.loss_tokens = (o.loss_chunk_tokens if o.loss_chunk_tokens != AUTO
                                 else max(1, budget // ((8 + elem) * vocab)) if vocab else 0)
        a = self.attached = Attached(model, self.group, tiles, o.ignore_index, run, o.tiled_mlp, o.tiled_loss)
        if is_hf(model):
            attach_hf(a)
        elif not attach_own(a):
            if self.group.distributed:
                raise ConfigError(f"{KEY} = {self.group.degree}: the model has no attention zeroplug can exchange "
                                  "(a Hugging Face causal LM, or attention modules with an attend(q, k, v) "
                                  "attribute: zeroplug.plugins.sequence.adapters)", key=KEY)
            a.tile_mlps()
            a.hook_forward(batched_positions=False)
        if run.rank == 0:
            g = self.group
            log.info("[zeroplug] sequence: %d rank(s) per sequence x %d data-parallel; MLP tiles of %s tokens (%d "
                     "modules); loss %s", g.degree, g.data_parallel_size, tiles.mlp_tokens or "-", a.mlps,
                     (f"in tiles of {tiles.loss_tokens} tokens" if a.loss and o.tiled_loss and tiles.loss_tokens
                      else "over the group" if a.loss else "the model's own"))

    def _budget(self) -> int:
        o, run = self.options, self.run
        if o.tile_bytes != AUTO:
            return o.tile_bytes
        if run.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(run.device)
            mine = max(64 << 20, min(2 * GiB, free // 16))
        else:
            mine = 256 << 20
        if run.comm.distributed:
            t = torch.tensor([mine], dtype=torch.int64,
                             device=run.device if run.comm.backend == "nccl" else "cpu")
            run.comm.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
            mine = int(t.item())
        return mine

    def close(self) -> None:
        a = getattr(self, "attached", None)
        if a is not None:
            a.undo()

    # -- the data side ------------------------------------------------------------------------
    def shard(self, batch: dict) -> dict:
        """This rank's slice of a batch of whole sequences (the same batch on the group's ranks)."""
        return shard_batch(batch, self.group.rank, self.group.degree, self.options.ignore_index)

    def loader(self, loader) -> ShardedLoader:
        """A loader of this rank's slices from ``loader``, whose ranks each load their own samples."""
        return ShardedLoader(loader, self.group, self.options.ignore_index)


def _mlp_width(model: torch.nn.Module) -> int:
    """The widest output of the linear layers inside modules named ``mlp`` (0: none)."""
    widths = [m.out_features for name, mlp in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp"
              for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
    return max(widths, default=0)


def _vocab(model: torch.nn.Module) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "head", None)
    return head.out_features if isinstance(head, torch.nn.Linear) else 0


_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # engine -> its strategy


def for_engine(engine) -> SequenceStrategy:
    """The ``[sequence]`` strategy attached to ``engine``: ``.group`` (this rank's
    :class:`SequenceGroup`: slice ``rank`` of ``degree``, ``data_parallel_rank`` / ``_size`` to pick
    samples with), ``.shard(batch)`` and ``.loader(loader)``."""
    try:
        return _ATTACHED[engine]
    except KeyError:
        raise RuntimeError("no [sequence] strategy is attached to this engine (is the built-in \"sequence\" "
                           "plugin blocked?)") from None


@hookimpl
def zeroplug_register_sequence(register):
    register("none", Whole)
    register("ulysses", Ulysses)


@hookimpl
def zeroplug_engine_setup(engine):
    choice = engine.config.slot("sequence")
    strategy = choice.impl(choice.options, engine.run)
    strategy.attach(engine)
    _ATTACHED[engine] = strategy


@hookimpl
def zeroplug_step_end(engine, metrics):
    """tokens_per_sec counts whole sequences: the engine sees one rank's slice of each."""
    strategy = _ATTACHED.get(engine)
    degree = strategy.group.degree if strategy is not None else 1
    if degree > 1 and metrics.get("tokens_per_sec") is not None:
        metrics["tokens_per_sec"] *= degree


@hookimpl
def zeroplug_sequence_strategy(engine):
    return _ATTACHED.get(engine)


@hookimpl
def zeroplug_engine_closed(engine):
    strategy = _ATTACHED.pop(engine, None)
    if strategy is not None:
        strategy.close()
