"""``zeroplug estimate --seq N``: what a long sequence's activations take, and which of the three
long-sequence mechanisms it needs to fit a device.

The activations of one micro batch of ``N`` tokens on one rank, from the model's shape (no probe
step: a probe at half a million tokens would take longer than the estimate is worth), in the
model dtype (2 bytes on a GPU) with activation checkpointing on every block:

* the checkpointed blocks' inputs: layers x tokens x d_model, for the whole backward;
* one block's recompute and backward (the largest transient): per token about 14 values of
  d_model (norms with fp32 temporaries, q / k / v, attention output and log-sum-exp, the
  residuals, and their gradients) and 6 of the MLP's widest layer (its outputs and gradients);
  tiled, the MLP's part is one chunk's;
* the logits with their fp32 copy and gradient: 10 bytes x vocabulary per token; tiled, one
  chunk's.

The checkpoints that go to the host share it with the other ranks of the sequence group on that
host (up to 8). The mechanisms, cheapest first: tiling the head's loss and the MLP (``[sequence] plugin =
"ulysses"``: recomputation only), the checkpointed inputs in host memory
(``[activation_checkpointing] plugin = "cpu"``: PCIe copies that overlap compute, and host
memory), and sequence parallelism over ``P`` ranks (``sequence_parallel_size``: more GPUs, each
holding ``N / P`` tokens). The estimate adds them in that order until the peak fits the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GiB = 1024 ** 3
#: values per token of one block's recompute and backward, per d_model and per MLP width
BLOCK_PER_D, BLOCK_PER_MLP = 14, 6
#: bytes per token and vocabulary entry of the untiled loss: logits, their fp32 copy, its gradient
LOGIT_BYTES = 10
#: the chunk of the tiled MLP and loss (tokens) the estimate assumes (the "auto" sizes are near it)
CHUNK = 8192
#: ranks of a sequence group on one host (torchrun places consecutive ranks together): their
#: host checkpoints share its memory
RANKS_PER_HOST = 8


@dataclass(frozen=True)
class Shape:
    layers: int
    d_model: int
    mlp: int
    vocab: int
    heads: int | None
    kv_heads: int | None

    @classmethod
    def of(cls, spec) -> "Shape":
        """The shape of a :class:`zeroplug.tools.probe.ModelSpec`'s model (built on the meta device)."""
        with torch.device("meta"):
            model = spec.build(None)
        cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "head", None)
        d = getattr(cfg, "hidden_size", None) or getattr(cfg, "d_model", None) or getattr(head, "in_features", 0)
        widths = [m.out_features for name, mlp in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp"
                  for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
        heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        return cls(spec.n_layer or 1, int(d), max(widths, default=4 * int(d)), spec.vocab_size, heads, kv)


@dataclass(frozen=True)
class Need:
    """Bytes per rank of one micro batch's activations with a choice of mechanisms."""
    tiled: bool
    on_host: bool
    degree: int
    checkpoints: float          # the checkpointed blocks' inputs
    block: float                # one block's recompute and backward
    logits: float               # the head's loss
    device: float               # the peak on the device
    host: float                 # on one host (the checkpoints of the group's ranks there, when there)
    kept: float = 0.0           # of the checkpoints, the bytes kept on the device (device_bytes)

    def label(self) -> str:
        parts = ["tiled MLP and loss"] if self.tiled else []
        if self.on_host:
            parts.append("checkpoints on the host" + (f", {self.kept / GiB:.0f} GiB of them on the device"
                                                      if self.kept else ""))
        if self.degree > 1:
            parts.append(f"sequence_parallel_size {self.degree}")
        return " + ".join(parts) or "as the model computes it"


def need(shape: Shape, seq: int, micro: int, elem: int, tiled: bool, on_host: bool, degree: int,
         in_flight: int = 2) -> Need:
    tokens = micro * -(-seq // degree)
    ck = shape.layers * tokens * shape.d_model * elem
    mlp_tokens = min(tokens, CHUNK) if tiled else tokens
    block = (tokens * BLOCK_PER_D * shape.d_model + mlp_tokens * BLOCK_PER_MLP * shape.mlp) * elem
    logits = (min(tokens, CHUNK) if tiled else tokens) * LOGIT_BYTES * shape.vocab
    ck_device = min(in_flight, shape.layers) * ck / shape.layers if on_host else ck
    # Note: the peak is the larger of the loss's backward (every checkpoint, the last hidden states
    # and their gradient, the logits) and a block's backward (the checkpoints and that block)
    hidden = 2 * tokens * shape.d_model * elem
    device = ck_device + max(hidden + logits, block)
    return Need(tiled, on_host, degree, ck, block, logits, device, ck * min(degree, RANKS_PER_HOST) if on_host else 0.0)


def plan(shape: Shape, seq: int, micro: int, elem: int, device_bytes: float, host_bytes: float,
         degree: int = 1) -> list[Need]:
    """The mechanisms added one at a time (tiles, host checkpoints, then doubled degrees that
    divide the heads) until the peak fits ``device_bytes`` with the checkpoints within
    ``host_bytes``; the last one fits, or is the furthest tried."""
    def fits(n: Need) -> bool:
        return n.device <= device_bytes and n.host <= host_bytes

    steps = [need(shape, seq, micro, elem, False, False, degree)]
    for tiled, on_host in ((True, False), (True, True)):
        if fits(steps[-1]):
            return steps
        steps.append(need(shape, seq, micro, elem, tiled, on_host, degree))
    if steps[-1].host > host_bytes:     # part of them on the device (activation_checkpointing.device_bytes)
        full = steps[-1]
        kept = min(full.checkpoints, max(0.0, device_bytes - full.device) // GiB * GiB)
        if kept:
            share = kept / full.checkpoints
            steps.append(Need(True, True, degree, full.checkpoints, full.block, full.logits, full.device + kept,
                              full.host * (1 - share), kept))
    p = degree
    while not fits(steps[-1]) and p < 4096 and (shape.heads or 1) % (2 * p) == 0:
        p *= 2
        on_device = need(shape, seq, micro, elem, True, False, p)
        steps.append(on_device if fits(on_device) else need(shape, seq, micro, elem, True, True, p))
    return steps


def report(spec, seq: int, micro: int, elem: int, device_bytes: float, host_bytes: float, degree: int,
           device_states: float) -> tuple[list[str], Need]:
    """Lines for ``zeroplug estimate --seq`` and the plan's last step."""
    shape = Shape.of(spec)
    room = max(0.0, device_bytes - device_states)
    steps = plan(shape, seq, micro, elem, room, host_bytes, degree)
    first, tiled = steps[0], need(shape, seq, micro, elem, True, False, degree)
    lines = [f"activations of one micro batch of {micro} x {seq:,} tokens ({shape.layers} layers, d_model "
             f"{shape.d_model}, MLP {shape.mlp}, vocabulary {shape.vocab:,}; {elem}-byte values; checkpointing every "
             f"block), per rank at sequence_parallel_size {degree}:",
             f"  checkpointed blocks' inputs {first.checkpoints / GiB:10.2f} GiB",
             f"  one block's recompute      {first.block / GiB:10.2f} GiB   (MLP tiled: {tiled.block / GiB:.2f} GiB)",
             f"  logits and their gradient  {first.logits / GiB:10.2f} GiB   (tiled: {tiled.logits / GiB:.2f} GiB)",
             f"device {device_bytes / GiB:.1f} GiB, less {device_states / GiB:.2f} GiB of states (stage 3, both tiers "
             f"offloaded) = {room / GiB:.1f} GiB for activations; host {host_bytes / GiB:.1f} GiB:"]
    for s in steps:
        fits = s.device <= room and s.host <= host_bytes
        lines.append(f"  {s.label():<72} device {s.device / GiB:8.2f} GiB  host {s.host / GiB:7.2f} GiB  "
                     f"{'fits' if fits else 'does not fit'}")
    last = steps[-1]
    if last.device <= room and last.host <= host_bytes:
        what = []
        if last.tiled and first.device > room:
            what.append("the MLP and the loss in tiles ([sequence] plugin = \"ulysses\")")
        if last.on_host:
            what.append("the checkpointed inputs in host memory ([activation_checkpointing] plugin = \"cpu\""
                        + (f", device_bytes = {int(last.kept)}" if last.kept else "") + ")")
        if last.degree > degree:
            what.append(f"sequence parallelism over {last.degree} ranks (sequence.sequence_parallel_size = "
                        f"{last.degree})")
        lines.append("needs: " + ("; ".join(what) if what else "nothing: it fits as the model computes it"))
    else:
        lines.append(f"needs: more than these mechanisms give (the last line's peak); use more ranks per sequence "
                     f"than the {shape.heads} heads allow, or a shorter sequence")
    return lines, last
