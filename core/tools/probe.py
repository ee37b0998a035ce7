"""Models named on the command line, and their activation memory measured by a probe step.

A model is named three ways: a preset of the built-in GPT (``1.3B``), a Hugging Face
``config.json`` (built with ``AutoModelForCausalLM.from_config``; transformers is an optional
extra) or ``module:function`` (a function that returns the model; its ``forward(x, y)``
returns the loss, or it is a Hugging Face model that takes ``input_ids`` and ``labels``).

Activation memory is measured, not guessed: one forward + backward of the batch. On CUDA
the allocator's peak, with the gradients allocated beforehand, so that what the step adds to
the parameters and gradients is its activations and the loss's temporaries. On the CPU,
which keeps no such count, the bytes of the tensors autograd saves for backward (parameters
excluded); the transient recompute of checkpointed blocks is not seen there. Layer stacks
are measured at one and two layers and extrapolated (the layers are alike); a model whose
depth cannot be changed is measured whole.

The model-state estimate counts the bytes per parameter of zeroplug's layout in the
categories of ``engine.memory_report()`` (see :func:`estimate_model_states`): with Adam in
mixed precision, at stage 3 16 bytes per parameter / N (fp32 master, fp32 gradient, m, v),
at stage 2 that plus 2 of model-dtype parameters. Activations are not sharded by any
stage: each rank holds its own micro-batch's.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from zeroplug.errors import ZeroplugError
from zeroplug.recompute import saved_by_checkpoint

_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_POSITION_KEYS = ("max_position_embeddings", "n_positions")


@dataclass
class ModelSpec:
    """How to build a model (whole, or with ``layers`` layers) and feed it."""
    name: str
    build: Callable[[int | None], torch.nn.Module]
    n_layer: int | None          # None: the depth cannot be changed (module:function)
    vocab_size: int
    hf: bool                     # batches are dicts of input_ids / labels
    max_seq: int | None = None   # the longest sequence the model takes (positions), if it says

    def seq_or_default(self, seq: int | None, option: str = "--seq") -> int:
        """``seq`` checked against the model's positions; None: 1024, or the model's length if shorter."""
        if seq is None:
            return min(1024, self.max_seq) if self.max_seq else 1024
        if self.max_seq and seq > self.max_seq:
            raise ZeroplugError(f"{option} {seq}: the model {self.name} takes at most {self.max_seq} positions; "
                                f"give {option} {self.max_seq} or less")
        return seq

    def num_params(self) -> int:
        with torch.device("meta"):
            model = self.build(None)
        return sum(p.numel() for p in model.parameters())

    def make_batch(self, micro_batch: int, seq: int) -> Callable:
        vocab, hf = self.vocab_size, self.hf

        def make(device):
            x = torch.randint(0, vocab, (micro_batch, seq + 1), device=device)
            if hf:
                return {"input_ids": x[:, :-1], "labels": x[:, :-1]}
            return x[:, :-1], x[:, 1:]
        return make


def presets() -> dict:
    """The model presets the plugins name (``zeroplug_model_presets``), by name."""
    from zeroplug.registry import get_plugin_manager
    found: dict = {}
    for answer in get_plugin_manager().hook.zeroplug_model_presets():
        found.update(answer or {})
    return found


def _hf_config(path: Path, checkpointing: bool) -> ModelSpec:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ZeroplugError(f"{path}: a Hugging Face config needs the transformers package "
                            "(pip install transformers)") from None
    try:
        raw = json.loads(path.read_text())
        model_type = raw.pop("model_type")
        base = AutoConfig.for_model(model_type, **raw)
    except (OSError, ValueError, KeyError) as exc:
        raise ZeroplugError(f"{path}: not a Hugging Face config.json with a model_type "
                            f"({type(exc).__name__}: {exc})") from None
    depth_key = next((k for k in _DEPTH_KEYS if isinstance(getattr(base, k, None), int)), None)

    def build(layers):
        cfg = base
        if layers and depth_key:
            cfg = type(base).from_dict({**base.to_dict(), depth_key: layers})
        model = AutoModelForCausalLM.from_config(cfg)
        if checkpointing and getattr(model, "supports_gradient_checkpointing", False):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    vocab = getattr(base, "vocab_size", None)
    if not isinstance(vocab, int):
        raise ZeroplugError(f"{path}: the config has no vocab_size")
    positions = next((v for k in _POSITION_KEYS if isinstance(v := getattr(base, k, None), int)), None)
    return ModelSpec(path.name, build, getattr(base, depth_key) if depth_key else None, vocab, hf=True,
                     max_seq=positions)


def _function(text: str, vocab_size: int | None) -> ModelSpec:
    mod_name, _, fn_name = text.partition(":")
    sys.path.insert(0, os.getcwd())       # as `python -m` would: modules next to the user
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ZeroplugError(f"--model {text}: cannot import {fn_name} from {mod_name} ({exc})") from None
    finally:
        sys.path.remove(os.getcwd())
    with torch.device("meta"):
        probe = fn()
    config = getattr(probe, "config", None)
    hf = config is not None and hasattr(config, "to_dict")
    vocab = vocab_size or getattr(config, "vocab_size", None) or getattr(getattr(probe, "cfg", None),
                                                                          "vocab_size", None)
    if not isinstance(vocab, int):
        raise ZeroplugError(f"--model {text}: the model has no config.vocab_size; give --vocab-size")
    positions = next((v for k in _POSITION_KEYS if isinstance(v := getattr(config, k, None), int)), None)
    positions = positions or getattr(getattr(probe, "cfg", None), "seq_len", None)
    return ModelSpec(text, lambda layers: fn(), None, vocab, hf=hf,
                     max_seq=positions if isinstance(positions, int) else None)


def load_spec(text: str, checkpointing: bool = True, vocab_size: int | None = None) -> ModelSpec:
    """A preset name, a path to a Hugging Face config.json, or ``module:function``."""
    named = presets()
    if text in named:
        return named[text](checkpointing)
    p = Path(text)
    if p.is_dir() and (p / "config.json").is_file():
        p = p / "config.json"
    if p.suffix == ".json" or p.is_file():
        if not p.is_file():
            raise ZeroplugError(f"--model {text}: no such file")
        return _hf_config(p, checkpointing)
    if ":" in text:
        return _function(text, vocab_size)
    raise ZeroplugError(f"--model {text}: not a preset ({', '.join(named) or 'none installed'}), a config.json or "
                        "module:function")


# -- the probe ------------------------------------------------------------------------------

@dataclass
class Activations:
    """Bytes of activation memory for the whole model, and how they were found."""
    total: float
    fixed: float = 0.0           # embeddings, head, loss
    per_layer: float = 0.0
    how: str = ""
    #: of ``total``, the checkpointed blocks' inputs: what [activation_checkpointing] plugin =
    #: "cpu" keeps in host memory (0 without activation checkpointing)
    checkpointed: float = 0.0
    layers: int = 1

    def split(self, on_host: bool, buffer_count: int = 2) -> tuple[float, float]:
        """(device bytes, host bytes) of the activations, with the checkpointed blocks' inputs
        on the host or not; on the host, up to ``buffer_count`` of them are on the device too
        (copies in flight, inputs fetched ahead)."""
        if not on_host or not self.checkpointed:
            return self.total, 0.0
        one = self.checkpointed / max(1, self.layers)
        return self.total - self.checkpointed + min(buffer_count, self.layers) * one, self.checkpointed


def _probe_once(spec: ModelSpec, layers: int | None, batch: Callable, device: torch.device,
                dtype: torch.dtype) -> tuple[float, float]:
    """(activation bytes, of which the checkpointed blocks' inputs) of one step."""
    from zeroplug.benchmarking.measure import forward_batch, loss_of, release
    torch.manual_seed(0)
    with torch.device(device):
        model = spec.build(layers).to(dtype)
    model.train()
    for p in model.parameters():       # Note: the gradients exist before the step, as under ZeRO
        p.grad = torch.zeros_like(p)
    inputs = batch(device)
    release(device)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    checkpointed: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.device.type != "meta":
            saved[storage.data_ptr()] = storage.nbytes()
            if not (t.is_leaf and t.requires_grad) and saved_by_checkpoint():
                checkpointed[storage.data_ptr()] = storage.nbytes()
        return t

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(forward_batch(model, inputs))
    loss.float().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        used = torch.cuda.max_memory_allocated(device) - base
    else:
        used = sum(saved.values())
    del model, inputs, loss
    release(device)
    return max(0.0, float(used)), float(sum(checkpointed.values()))


def measure_activations(spec: ModelSpec, micro_batch: int, seq: int, device: torch.device,
                        dtype: torch.dtype) -> Activations:
    """Activation bytes of one micro-batch, measured on ``device`` (see the module's docstring)."""
    batch = spec.make_batch(micro_batch, seq)
    if spec.n_layer and spec.n_layer > 2:
        one, ck_one = _probe_once(spec, 1, batch, device, dtype)
        two, ck_two = _probe_once(spec, 2, batch, device, dtype)
        per_layer = max(0.0, two - one)
        fixed = max(0.0, one - per_layer)
        ck = max(0.0, ck_one - max(0.0, ck_two - ck_one)) + spec.n_layer * max(0.0, ck_two - ck_one)
        total = fixed + spec.n_layer * per_layer
        return Activations(total, fixed, per_layer,
                           f"measured on {device.type} at 1 and 2 layers, extrapolated to {spec.n_layer}",
                           checkpointed=min(ck, total), layers=spec.n_layer)
    total, ck = _probe_once(spec, None, batch, device, dtype)
    return Activations(total, total, 0.0, f"measured on {device.type}, whole model", checkpointed=min(ck, total),
                       layers=spec.n_layer or 1)


def estimate_inputs(model: str, micro_batch: int | None, seq: int | None, device: str,
                    checkpointing: bool = True) -> tuple[int, Activations | None, int]:
    """For ``zeroplug estimate``: the parameter count of ``model`` and, with a micro batch, its
    measured activations on ``device`` (cpu, cuda or auto) at the sequence length returned last
    (``seq``, or the default for this model when None)."""
    if micro_batch is not None and (micro_batch < 1 or (seq is not None and seq < 1)):
        raise ZeroplugError("--micro-batch and --seq must be at least 1")
    spec = load_spec(model, checkpointing)
    seq = spec.seq_or_default(seq)
    if micro_batch is None:
        return spec.num_params(), None, seq
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ZeroplugError("--device cuda: no CUDA device is visible; use --device cpu")
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return spec.num_params(), measure_activations(spec, micro_batch, seq, dev, dtype), seq


CATEGORIES = ("lp_params", "master", "gradients", "optimizer")   # engine.memory_report()'s names


def estimate_model_states(num_params: int, stage: int, world_size: int,
                          param_bytes: int = 2, offload_optimizer: bool = False,
                          offload_param: bool = False, activations: float = 0.0,
                          host_activations: float = 0.0, state_dtype: str = "fp32") -> dict:
    """Bytes per rank at the optimizer step, by ``engine.memory_report()``'s categories, on the
    device and on the host, as zeroplug lays the states out (Adam, fp32 masters):

    * lp_params: the model-dtype parameters; stage 3 keeps none beside an fp32 master on the
      device (a gather casts it), a model-dtype shard when the master is offloaded;
    * master: fp32, sharded from stage 1 (none of its own for an fp32 model: the parameters);
    * gradients: stages 0-1 a model-dtype flat buffer plus the fp32 shard, stages 2-3 the fp32
      shard; the fp32 shard exists from backward to the step (with the master when offloaded).
      Stages 2-3 on one rank with the optimizer on the device keep the model-dtype gradients
      and widen an eighth of them at a time in the step (plugins/zero/lp_grads.py; with no
      gradient accumulation and a fused optimizer, the defaults);
    * optimizer: Adam's two moments: fp32 (8 bytes), or with the optimizer offloaded as
      ``state_dtype`` says (optimizer.state_dtype: bf16 4 bytes, int8 2 + 8 per 256).

    ``device`` adds ``activations`` (one micro-batch's; no stage shards them), ``host`` adds
    ``host_activations`` (the checkpointed blocks' inputs the cpu activation store holds there;
    see :meth:`Activations.split`)."""
    n = max(1, world_size)
    sharded = lambda b, from_stage: num_params * b / (n if stage >= from_stage else 1)   # noqa: E731
    fp32 = param_bytes == 4
    if stage >= 3:
        keep_lp = fp32 or offload_optimizer or offload_param
        lp = sharded(param_bytes, 3) if keep_lp else 0.0
    else:
        lp = num_params * param_bytes
    master = 0.0 if fp32 else sharded(4, 1)
    flat = num_params * param_bytes if stage <= 1 else 0.0
    grad32 = 0.0 if fp32 and stage <= 1 else sharded(4, 2) if stage >= 2 else sharded(4, 1)
    if stage >= 2 and n == 1 and not fp32 and not offload_optimizer:
        grad32 = num_params * (param_bytes + 4 / 8)       # (8: lp_grads.SLICES)
    from zeroplug.quantized_states import state_bytes
    optim = sharded(state_bytes(state_dtype if offload_optimizer else "fp32"), 1)
    where = {"lp_params": offload_param, "master": offload_optimizer, "optimizer": offload_optimizer}
    cats = {"lp_params": lp, "master": master, "gradients": flat + grad32, "optimizer": optim}
    device = {k: v for k, v in cats.items() if not where.get(k)}
    host = {k: v for k, v in cats.items() if where.get(k)}
    if offload_optimizer:       # the fp32 gradient shard lives with the master
        device["gradients"], host["gradients"] = flat, grad32
    return {"device": sum(device.values()) + activations, "host": sum(host.values()) + host_activations,
            "device_categories": device, "host_categories": host, "activations": activations,
            "host_activations": host_activations}
