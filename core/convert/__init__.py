"""DeepSpeed configs into zeroplug's layout: ``zeroplug convert``, and DeepSpeed JSON files or
dicts given to ``zeroplug.initialize``. What each DeepSpeed key becomes is the table in
keys.py; this module applies it, fills DeepSpeed's ``"auto"`` values and checks
the combinations DeepSpeed refuses (docs/deepspeed-compat.md is generated from both).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from zeroplug.errors import ConfigError
from zeroplug.options import suggest

from .keys import (AUTO, HIDDEN, IGNORED, KEEP, OFF, OPTIMIZERS, REFUSED, REFUSED_OPTIMIZERS, RULES, SCHEDULERS,
                   STRICT_SECTIONS, ANY, Rule)

_BATCH = {"train_batch_size": "batch.train_batch_size", "train_micro_batch_size_per_gpu": "batch.micro_batch_size",
          "gradient_accumulation_steps": "batch.gradient_accumulation_steps"}
_HIDDEN_FORMULAS = {"zero.reduce_bucket_size": lambda h: h * h,
                    "zero.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                    "zero.stage3_param_persistence_threshold": lambda h: 10 * h}
#: offload keys that only the nvme tier has (DeepSpeed accepts and ignores them for "cpu")
_NVME_ONLY = ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write",
              "fast_init")
#: zeroplug's own table names: a dict with none of DeepSpeed's keys is a zeroplug config
_ZEROPLUG_TABLES = {"batch", "checkpoint", "zero", "precision", "optimizer", "scheduler", "offload", "monitor",
                    "aio", "activation_checkpointing", "sequence"}


@dataclass
class Translation:
    """What the translation of one DeepSpeed config did, for the start-up report."""
    notes: list[str] = field(default_factory=list)     # one line each: ignored keys and why
    autos: list[tuple[str, str, str]] = field(default_factory=list)   # (DeepSpeed key, zeroplug key, source)
    origin: dict[str, str] = field(default_factory=dict)   # zeroplug key -> DeepSpeed key
    hidden: list[str] = field(default_factory=list)    # zeroplug keys to fill from the model's hidden size
    batch: dict = field(default_factory=dict)          # the DeepSpeed batch sizes given as numbers
    sequence_parallel_size: int = 1                    # ranks per sequence: the batch counts world / this
    reported: bool = False


class DeepSpeedRaw(dict):
    """A zeroplug raw config translated from DeepSpeed; ``translation`` says how."""
    translation: Translation


def looks_like_deepspeed(raw: dict) -> bool:
    """Whether a dict is a DeepSpeed config (rather than zeroplug's layout)."""
    if isinstance(raw, DeepSpeedRaw):
        return False
    if any(k in RULES and k not in _ZEROPLUG_TABLES for k in raw):
        return True
    return any(isinstance(raw.get(t), dict) and ("type" in raw[t] or "params" in raw[t])
               for t in ("optimizer", "scheduler"))


def hidden_size_of(model) -> int | None:
    """The model's hidden size as the Hugging Face integration reads it (its config), or None."""
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        h = getattr(c, "hidden_size", None)
        if isinstance(h, int):
            return h
        hs = getattr(c, "hidden_sizes", None)
        if hs:
            return max(hs)
    return None


def _generic(path: str) -> str:
    """The rule-table spelling of a path: both offload tables share ``offload_*``'s rules."""
    return path.replace("offload_optimizer", "offload_*").replace("offload_param", "offload_*")


def rule_for(path: str) -> Rule | None:
    p = _generic(path)
    if p in RULES:
        return RULES[p]
    head = p.rpartition(".")[0]
    return RULES.get(head + ".*") if head else None


def _same_value(a, b) -> bool:
    return a is b if isinstance(a, bool) or isinstance(b, bool) else a == b


def _on(value) -> bool:
    """Whether a section asks for anything: ``enabled`` true, or any truthy value in it."""
    if isinstance(value, dict):
        if "enabled" in value:
            return _on(value["enabled"])
        return any(_on(v) for v in value.values())
    if isinstance(value, str):
        return value.strip().lower() not in ("", "false", "none", "0", "auto")
    return bool(value)


def _quiet(rule: Rule, value) -> bool:
    if rule.quiet == ANY:
        return True
    if rule.quiet == OFF:
        return not _on(value)
    return any(_same_value(value, q) for q in rule.quiet)


def _show(value) -> str:
    text = json.dumps(value) if not isinstance(value, tuple) else json.dumps(list(value))
    return text if len(text) <= 60 else text[:57] + "..."


def _set(raw: dict, path: str, value) -> None:
    parts = path.split(".")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def get_path(raw: dict, path: str, default=None):
    """``raw``'s value at the dotted ``path`` ("zero.stage"), or ``default`` where it has none."""
    node = raw
    for p in path.split("."):
        if not isinstance(node, dict) or p not in node:
            return default
        node = node[p]
    return node


def _share(path: str, v) -> float:
    """A number in [0, 1] (a numeric string too, as DeepSpeed's pydantic reads it)."""
    try:
        x = float(v) if not isinstance(v, bool) else None
    except (TypeError, ValueError):
        x = None
    if x is None or not 0 <= x <= 1:
        raise ConfigError(f"DeepSpeed key {path} = {_show(v)}: the share of the optimizer states offloaded "
                          f"is a number between 0 and 1", key=path)
    return x


class _Translator:
    def __init__(self):
        self.raw = DeepSpeedRaw()
        self.t = Translation()
        self.raw.translation = self.t
        self.stage = 0
        self.offloaded = False

    # -- helpers ---------------------------------------------------------------------
    def note(self, text: str) -> None:
        self.t.notes.append(text)

    def value(self, path: str, value):
        """DeepSpeed reads "true" / "false" strings as booleans (pydantic): so does zeroplug, with a word."""
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            b = value.strip().lower() == "true"
            self.note(f"{path} = {_show(value)} (a string) read as {str(b).lower()}; write {str(b).lower()} "
                      f"without quotes")
            return b
        return value

    def put(self, target: str, path: str, value, how: str | None = None) -> None:
        value = self.value(path, value)
        self.t.origin[target] = path
        if value == "auto":
            if target.startswith("zero.stage3_") and self.stage < 3:
                return          # Note: DeepSpeed drops "auto" in its sections; these matter at stage 3 only
            fill, src = AUTO.get(target, (None, "zeroplug's default"))
            if how is not None:
                fill, src = KEEP, how
            self.t.autos.append((path, target, src))
            if fill is None:
                return
            if fill == HIDDEN:
                self.t.hidden.append(target)
                fill = "auto"
            elif fill == KEEP:
                fill = "auto"
            value = list(fill) if isinstance(fill, tuple) else fill
        _set(self.raw, target, value)

    def key(self, path: str, value, strict: bool) -> None:
        """Apply the rule of one DeepSpeed key (recursing into sections that have rules per key)."""
        rule = rule_for(path)
        if rule is None:
            head, _, name = path.rpartition(".")
            if not head:
                if not name.startswith("_"):      # "_comment" and the like
                    self.note(f"{name} is not a DeepSpeed key; DeepSpeed ignores it and so does zeroplug."
                              f"{suggest(name, [k for k in RULES if '.' not in k])}")
                return
            if strict:
                section = _generic(head)
                known = sorted(k.rpartition(".")[2] for k in RULES
                               if k.rpartition(".")[0] == section and not k.endswith("*"))
                raise ConfigError(f"unknown DeepSpeed key {path} (DeepSpeed refuses it too).{suggest(name, known)}"
                                  f" The keys zeroplug knows: docs/deepspeed-compat.md", key=path)
            return
        value = self.value(path, value)
        if rule.kind == IGNORED:
            if not _quiet(rule, value):
                self.note(f"{path} = {_show(value)} ignored: {rule.why}")
        elif rule.kind == REFUSED:
            if not _quiet(rule, value):
                raise ConfigError(f"DeepSpeed key {path} = {_show(value)} is not supported: {rule.why}", key=path)
        elif isinstance(value, dict) and any(k.startswith(path + ".") for k in RULES):
            self.walk(path, value)
        elif rule.target and "[" not in rule.target and "*" not in rule.target:
            self.put(rule.target, path, value)

    def walk(self, section: str, table: dict, skip=()) -> None:
        for k, v in table.items():
            if k not in skip:
                self.key(f"{section}.{k}", v, strict=_generic(section) in STRICT_SECTIONS)

    def table(self, path: str, value) -> dict:
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"DeepSpeed key {path} must be a table ({{...}}), got {_show(value)}", key=path)
        return value or {}

    # -- sections ----------------------------------------------------------------------
    def run(self, ds: dict) -> DeepSpeedRaw:
        if not isinstance(ds, dict):
            raise ConfigError(f"a DeepSpeed config must be a JSON object, got {type(ds).__name__}")
        self.batch(ds)
        self.zero(ds.get("zero_optimization"))
        self.precision(ds)
        self.optimizer(self.table("optimizer", ds.get("optimizer")))
        self.scheduler(self.table("scheduler", ds.get("scheduler")))
        self.activations(self.table("activation_checkpointing", ds.get("activation_checkpointing")))
        self.sequence(ds.get("sequence_parallel_size"))
        done = {*_BATCH, "zero_optimization", "fp16", "bf16", "bfloat16", "communication_data_type", "optimizer",
                "scheduler", "activation_checkpointing", "sequence_parallel_size"}
        for k, v in ds.items():
            if k not in done:
                self.key(k, v, strict=False)
        return self.raw

    def activations(self, ac: dict) -> None:
        path = "activation_checkpointing.cpu_checkpointing"
        cpu = self.value(path, ac.get("cpu_checkpointing", False))
        if not isinstance(cpu, bool):
            raise ConfigError(f"DeepSpeed key {path} = {_show(cpu)}: use true or false", key=path)
        if cpu:
            self.t.origin["activation_checkpointing.plugin"] = path
            _set(self.raw, "activation_checkpointing.plugin", "cpu")
        self.walk("activation_checkpointing", ac, skip=("cpu_checkpointing",))

    def sequence(self, size) -> None:
        """sequence_parallel_size above 1: the ulysses plugin with that many ranks per sequence."""
        path = "sequence_parallel_size"
        size = self.value(path, size)
        if size is None or size == 1:
            return
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"DeepSpeed key {path} = {_show(size)}: use a positive integer", key=path)
        self.t.origin["sequence.plugin"] = path
        self.t.origin["sequence.sequence_parallel_size"] = path
        self.t.sequence_parallel_size = size
        _set(self.raw, "sequence.plugin", "ulysses")
        _set(self.raw, "sequence.sequence_parallel_size", size)

    def batch(self, ds: dict) -> None:
        def number(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        tbs, mbs = ds.get("train_batch_size"), ds.get("train_micro_batch_size_per_gpu")
        for ds_key, target in _BATCH.items():
            if ds_key not in ds:
                continue
            how = None
            if ds[ds_key] == "auto" and target == "batch.micro_batch_size" and number(tbs):
                how = "train_batch_size / (accumulation x world size)"
            elif ds[ds_key] == "auto" and target == "batch.gradient_accumulation_steps" and number(tbs) and number(mbs):
                how = "train_batch_size / (micro batch x world size)"
            self.put(target, ds_key, ds[ds_key], how)
        self.t.batch = {k: ds[k] for k in _BATCH if number(ds.get(k))}

    def zero(self, z) -> None:
        path = "zero_optimization"
        if isinstance(z, bool):
            self.note(f"{path} = {str(z).lower()} (DeepSpeed's old form) read as stage {int(z)}")
            z = {"stage": int(z)}
        z = dict(self.table(path, z))
        stage = self.value(f"{path}.stage", z.get("stage", 0))
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ConfigError(f"DeepSpeed key {path}.stage = {_show(stage)}: the ZeRO stage is 0, 1, 2 or 3",
                              key=f"{path}.stage")
        self.stage = stage
        self.t.origin["zero.plugin"] = f"{path}.stage"
        _set(self.raw, "zero.plugin", f"stage{stage}")
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if self.value(f"{path}.{old}", z.get(old)) is True:
                if z.get(new) is not None:
                    raise ConfigError(f"DeepSpeed keys {path}.{old} and {path}.{new} are both set (DeepSpeed refuses "
                                      f"this too): keep {new}", key=f"{path}.{old}")
                z[new] = {"device": "cpu"}
        pin = z.get("cpu_offload_use_pin_memory")
        opt, par = (self.table(f"{path}.{k}", z.get(k)) for k in ("offload_optimizer", "offload_param"))
        if pin is not None:
            opt, par = ({"pin_memory": pin, **t} if t else t for t in (opt, par))
        dev_opt, dev_par = self.device(f"{path}.offload_optimizer", opt), self.device(f"{path}.offload_param", par)
        if dev_par != "none" and stage < 3:
            # Note: DeepSpeed ignores it below stage 3 too (configs shared across stages carry it)
            self.note(f"{path}.offload_param (device {dev_par}) ignored at stage {stage}: only stage 3 shards "
                      f"the parameters, so there are none to offload (as DeepSpeed ignores it); set stage 3 to "
                      f"offload them, or remove offload_param")
            dev_par = "none"
        if dev_par != "none" and dev_opt == "none":
            self.note(f"{path}.offload_param without offload_optimizer: zeroplug offloads the optimizer to the CPU "
                      f"too (its fp32 masters update the host shards); the same update, more host memory")
            opt, dev_opt = {"device": "cpu"}, "cpu"
        self.offloaded = dev_opt != "none"
        self.offload("optimizer", opt, dev_opt)
        self.offload("param", par, dev_par)
        if z.get("reduce_bucket_size") == 0:        # DeepSpeed: every gradient reduced on its own
            z["reduce_bucket_size"] = 1
        if z.get("sub_group_size") == 0:            # DeepSpeed: one parameter per sub-group
            z.pop("sub_group_size")
        self.shard_group(path, z, stage)
        self.walk(path, z, skip=("stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param",
                                 "cpu_offload_use_pin_memory", "mics_shard_size", "zero_hpz_partition_size"))

    def shard_group(self, path: str, z: dict, stage: int) -> None:
        """MiCS's ``mics_shard_size`` (``zero.shard_group_size``) and ZeRO++'s
        ``zero_hpz_partition_size`` (the same name): both group the ranks, at stage 3 only."""
        mics = self.value(f"{path}.mics_shard_size", z.get("mics_shard_size", -1))
        hpz = self.value(f"{path}.zero_hpz_partition_size", z.get("zero_hpz_partition_size", 1))
        for key, v, off in (("mics_shard_size", mics, -1), ("zero_hpz_partition_size", hpz, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < off or v == 0:
                raise ConfigError(f"DeepSpeed key {path}.{key} = {_show(v)}: a number of ranks ({off} = off)",
                                  key=f"{path}.{key}")
        on = [(k, v) for k, v, off in (("mics_shard_size", mics, -1), ("zero_hpz_partition_size", hpz, 1)) if v != off]
        if not on:
            return
        if stage < 3:
            self.note(f"{path}.{on[0][0]} = {on[0][1]} ignored at stage {stage}: it shards within groups at stage 3 "
                      "only (as DeepSpeed ignores it); zeroplug's zero.shard_group_size also groups stages 1-2")
            return
        if len(on) == 2:
            raise ConfigError(f"DeepSpeed keys {path}.mics_shard_size = {mics} and {path}.zero_hpz_partition_size = "
                              f"{hpz} both group the ranks (MiCS and ZeRO++ hpZ); keep one",
                              key=f"{path}.zero_hpz_partition_size")
        key, size = on[0]
        target = "zero.shard_group_size" if key == "mics_shard_size" else "zero.zero_hpz_partition_size"
        self.put(target, f"{path}.{key}", size)

    def device(self, path: str, table: dict) -> str:
        dev = self.value(f"{path}.device", table.get("device", "none")) if table else "none"
        if dev not in ("none", "cpu", "nvme"):
            raise ConfigError(f"DeepSpeed key {path}.device = {_show(dev)}: use \"cpu\", \"nvme\" or \"none\"",
                              key=f"{path}.device")
        if dev == "nvme" and not table.get("nvme_path"):
            raise ConfigError(f"DeepSpeed key {path}.device = \"nvme\" needs {path}.nvme_path: set it to a directory "
                              f"on a local NVMe disk, e.g. \"/local_nvme\"", key=f"{path}.nvme_path")
        return dev

    def offload(self, which: str, table: dict, device: str) -> None:
        path = f"zero_optimization.offload_{which}"
        for k in table:                        # unknown keys are refused whatever the device
            if rule_for(f"{path}.{k}") is None:
                self.key(f"{path}.{k}", table[k], strict=True)
        if device == "none":
            return
        target = f"offload.{which}"
        self.t.origin[f"{target}.plugin"] = f"{path}.device"
        _set(self.raw, f"{target}.plugin", device)
        for k, v in table.items():
            if k == "device" or (k in _NVME_ONLY and device != "nvme"):
                continue
            if k == "ratio":
                ratio = _share(f"{path}.ratio", v)
                if ratio != 1 and (which != "optimizer" or device != "cpu"):
                    raise ConfigError(f"DeepSpeed key {path}.ratio = {_show(v)}: a partial offload needs "
                                      f"offload_optimizer on the cpu; remove it", key=f"{path}.ratio")
                if ratio != 1:      # the rest stays on the GPU, stepped there
                    self.put(f"{target}.gpu_resident_ratio", f"{path}.ratio", 1.0 - ratio)
                continue
            rule = rule_for(f"{path}.{k}")
            if rule.kind in (IGNORED, REFUSED):
                self.key(f"{path}.{k}", v, strict=True)
            else:
                self.put(rule.target.replace("offload.*", target), f"{path}.{k}", v)

    def enabled(self, path: str, section: dict):
        if "enabled" not in section:
            return None if not section else False
        v = self.value(f"{path}.enabled", section["enabled"])
        if v not in (True, False, "auto"):
            raise ConfigError(f"DeepSpeed key {path}.enabled = {_show(v)}: use true, false or \"auto\"",
                              key=f"{path}.enabled")
        return v

    def precision(self, ds: dict) -> None:
        fp16 = self.table("fp16", ds.get("fp16"))
        bname = "bf16" if "bf16" in ds else "bfloat16"
        bf16 = self.table(bname, ds.get(bname))
        if "bf16" in ds and "bfloat16" in ds:
            self.note("bfloat16 ignored: bf16 is given too (DeepSpeed reads bf16 first)")
        on16, onbf = self.enabled("fp16", fp16), self.enabled(bname, bf16)
        if on16 is True and onbf is True:
            raise ConfigError(f"DeepSpeed keys fp16.enabled and {bname}.enabled are both true (DeepSpeed refuses this "
                              f"too): keep one, bf16 where the GPU has it", key="fp16.enabled")
        for name, section, on in (("fp16", fp16, on16), (bname, bf16, onbf)):
            for k, v in section.items():
                if k == "enabled":
                    continue
                p = f"{name}.{k}".replace("bfloat16.", "bf16.")
                if p == "bf16.bf16_optimizer_states" and on is True:
                    self.small_states(p, v is True)
                elif rule_for(p) is None or on is True:
                    self.key(p, v, strict=True)
        if on16 is True:
            _set(self.raw, "precision.plugin", "fp16")
        elif onbf is True:
            _set(self.raw, "precision.plugin", "bf16")
        elif "auto" in (on16, onbf):
            self.t.autos.append((f"{'fp16' if on16 == 'auto' else bname}.enabled", "precision.plugin",
                                 AUTO["precision.plugin"][1]))
        elif False in (on16, onbf):
            _set(self.raw, "precision.plugin", "fp32")
        self.t.origin["precision.plugin"] = "fp16.enabled" if on16 is not None else f"{bname}.enabled"
        if "communication_data_type" in ds:
            self.reduce_dtype(self.value("communication_data_type", ds["communication_data_type"]))

    def small_states(self, path: str, bf16: bool) -> None:
        """``path`` asks for bf16 optimizer states (``bf16``) or fp32 ones: optimizer.state_dtype
        where cpu_adam steps offloaded states; on the GPU torch's kernels step fp32 states."""
        if not bf16:
            return
        if not self.offloaded:
            self.note(f"{path} = true ignored: without offload_optimizer the optimizer states stay on the GPU, "
                      f"where torch's kernels step them in fp32 (zeroplug's bf16 / int8 states are cpu_adam's, "
                      f"for offloaded states)")
            return
        self.put("optimizer.state_dtype", path, "bf16")

    def reduce_dtype(self, value) -> None:
        plugin = get_path(self.raw, "precision.plugin")
        dtype = str(value).lower()
        offered = {"fp16": ("fp32", "fp16"), "bf16": ("fp32", "bf16"), "fp32": ("fp32",)}.get(plugin, ())
        if dtype in offered and plugin != "fp32":
            self.put("precision.reduce_dtype", "communication_data_type", dtype)
        elif not (dtype == "fp32" and plugin == "fp32"):
            self.note(f"communication_data_type = {_show(value)} ignored: zeroplug's precision "
                      f"{plugin or '(left to the launcher)'} reduces in {offered or 'its own dtype'}")

    def optimizer(self, opt: dict) -> None:
        if not opt:
            self.note("no optimizer section: DeepSpeed takes the optimizer its caller builds; zeroplug uses "
                      "[optimizer]'s defaults (docs/configuration.md)"
                      + (" with plugin = \"auto\" (cpu_adam for the offloaded states)" if self.offloaded else ""))
            if self.offloaded:
                _set(self.raw, "optimizer.plugin", "auto")
            return
        if "type" not in opt:
            self.note("optimizer without a type: DeepSpeed takes the optimizer its caller builds; zeroplug uses "
                      "[optimizer]'s default")
        self.walk("optimizer", opt, skip=("type", "params"))
        params = dict(self.table("optimizer.params", opt.get("params")))
        name = str(opt.get("type", "adamw")).lower()
        if name in REFUSED_OPTIMIZERS:
            raise ConfigError(f"DeepSpeed key optimizer.type = {_show(opt.get('type'))} is not supported: "
                              f"{REFUSED_OPTIMIZERS[name]}", key="optimizer.type")
        if name not in OPTIMIZERS:
            self.torch_optimizer(str(opt.get("type")), params)
            return
        plugin = OPTIMIZERS[name]
        if plugin == "muon":        # DeepSpeed's Muon: its rule and its Adam's defaults
            _set(self.raw, "optimizer.rule", "deepspeed")
            params.setdefault("betas", [0.9, 0.95])
            params.setdefault("eps", 1e-10)
        if "fp32_optimizer_states" in params:
            fp32 = self.value("optimizer.params.fp32_optimizer_states", params.pop("fp32_optimizer_states"))
            self.small_states("optimizer.params.fp32_optimizer_states", fp32 is False)
        if plugin == "adamw":
            w = self.value("optimizer.params.adam_w_mode", params.pop("adam_w_mode", True))
            w = name == "adamw" or self.value("optimizer.params.adamw_mode", params.pop("adamw_mode", w))
            bias = self.value("optimizer.params.bias_correction", params.pop("bias_correction", True))
            if bias is False:
                plugin = "cpu_adam"
                self.note("optimizer.params.bias_correction = false: optimizer.plugin = cpu_adam, the zeroplug "
                          "optimizer with that switch; it steps states held in CPU memory (a CPU run, or "
                          "offload_optimizer)")
                _set(self.raw, "optimizer.bias_correction", False)
            elif self.offloaded:
                plugin = "auto" if w else "cpu_adam"
            else:
                plugin = "adamw" if w else "adam"
            if plugin in ("auto", "cpu_adam") and not w:
                # true is the default: left out, so that --optimizer.plugin=adamw still applies
                _set(self.raw, "optimizer.adamw_mode", False)
        self.t.origin["optimizer.plugin"] = "optimizer.type"
        _set(self.raw, "optimizer.plugin", plugin)
        self.walk("optimizer.params", params)

    def torch_optimizer(self, name: str, params: dict) -> None:
        """DeepSpeed builds ``getattr(torch.optim, type)`` for a type of its own it does not
        know: zeroplug's ``torch`` plugin steps such a class when its update is element-wise."""
        import torch
        cls = getattr(torch.optim, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ConfigError(f"DeepSpeed key optimizer.type = {_show(name)} is not an optimizer DeepSpeed builds "
                              "(its own: Adam, AdamW, SGD, Muon, Lion, Lamb, Adagrad, ...; or a torch.optim class "
                              "name, which is case-sensitive)", key="optimizer.type")
        self.t.origin["optimizer.plugin"] = "optimizer.type"
        _set(self.raw, "optimizer.plugin", "torch")
        _set(self.raw, "optimizer.name", name)
        self.walk("optimizer.params", params)

    def scheduler(self, sch: dict) -> None:
        if not sch:
            return
        self.walk("scheduler", sch, skip=("type", "params"))
        name = str(sch.get("type")).lower()
        if name not in SCHEDULERS:
            raise ConfigError(f"DeepSpeed key scheduler.type = {_show(sch.get('type'))} is not supported: zeroplug's "
                              f"schedules are WarmupLR, WarmupDecayLR and WarmupCosineLR; another schedule "
                              f"would train with other learning rates. Use one of those, or remove the scheduler "
                              f"(constant lr)", key="scheduler.type")
        self.t.origin["scheduler.plugin"] = "scheduler.type"
        _set(self.raw, "scheduler.plugin", SCHEDULERS[name])
        self.walk("scheduler.params", dict(self.table("scheduler.params", sch.get("params"))))


def from_deepspeed(ds: dict, notes: list[str] | None = None) -> DeepSpeedRaw:
    """Translate a DeepSpeed config dict into zeroplug's layout. ``notes`` collects what is
    ignored and why; the result's ``translation`` has that and the "auto" values filled."""
    raw = _Translator().run(ds)
    if notes is not None:
        notes.extend(raw.translation.notes)
    return raw


def fill_from_model(raw: DeepSpeedRaw, model) -> None:
    """The "auto" sizes that follow the model's hidden size (as the Hugging Face integration fills them)."""
    h = hidden_size_of(model) if model is not None else None
    if h is None:
        return
    for target in raw.translation.hidden:
        if get_path(raw, target) == "auto":
            _set(raw, target, _HIDDEN_FORMULAS[target](h))


def check_batch(raw: DeepSpeedRaw, world: int) -> None:
    """DeepSpeed's batch arithmetic, with DeepSpeed's key names in the message (the world counts
    data-parallel ranks: world size / sequence_parallel_size, as DeepSpeed counts them)."""
    b = raw.translation.batch
    t, m, g = (b.get(k) for k in _BATCH)
    sp = raw.translation.sequence_parallel_size
    if sp > 1 and world % sp == 0:
        world //= sp
    names = ("train_micro_batch_size_per_gpu ({}) x gradient_accumulation_steps ({}) x "
             + ("world size ({})" if sp == 1 else f"data-parallel ranks ({{}} = world size / sequence_parallel_size {sp})"))
    if t is not None and m is not None and g is not None and t != m * g * world:
        raise ConfigError(f"DeepSpeed keys disagree: train_batch_size = {t}, but {names.format(m, g, world)} = "
                          f"{m * g * world} (DeepSpeed refuses this too). Set train_batch_size to {m * g * world} or "
                          f"\"auto\"", key="train_batch_size")
    for given, name in ((m, "train_micro_batch_size_per_gpu"), (g, "gradient_accumulation_steps")):
        if t is not None and given is not None and (m is None or g is None) and t % (given * world):
            raise ConfigError(f"DeepSpeed key train_batch_size = {t} is not a multiple of {name} ({given}) x world "
                              f"size ({world}) = {given * world}, so the other batch size cannot be derived; set "
                              f"train_batch_size to a multiple of {given * world}", key="train_batch_size")


from .toml import convert_text, to_toml  # noqa: E402,F401  (they use the translator above)
