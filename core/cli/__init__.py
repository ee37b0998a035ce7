"""``zeroplug train | export | plugins | estimate | tune | report | convert | docs``.

A front end over the public API, outside the core: ``train`` is the demo's loop
(the built-in ``workload`` plugin, through ``zeroplug_add_commands``), ``tune`` and ``report`` live in :mod:`zeroplug.tools`.
Config precedence everywhere: command line (``--section.key=value``) > file > defaults.
Every configuration mistake prints ``error: ...`` and exits 2, without a traceback.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zeroplug.errors import ZeroplugError


def _split_overrides(argv):
    """``--section.key=value`` items (a dot before '=') are config overrides; the rest is argparse's."""
    overrides, rest = [], []
    for a in argv:
        head = a.split("=", 1)[0]
        if a.startswith("--") and "." in head:
            overrides.append(a)
        else:
            rest.append(a)
    return overrides, rest


def cmd_export(args, overrides) -> int:
    from zeroplug.checkpoint.deepspeed_files import find_deepspeed_checkpoint
    if (args.dtype == "fp32" or args.format is not None or args.max_shard_size is not None
            or find_deepspeed_checkpoint(args.checkpoint, args.tag) is not None):
        from zeroplug.checkpoint.fp32_export import export_fp32, open_source, write_state_dict
        if args.dtype == "fp32":
            files = export_fp32(args.checkpoint, args.out, tag=args.tag, fmt=args.format,
                                max_shard_size=args.max_shard_size)
        else:
            files = write_state_dict(open_source(args.checkpoint, args.tag, dtype=None), args.out, args.format,
                                     args.max_shard_size)
        for f in files:
            print(f"wrote {f}")
        return 0
    from zeroplug.checkpoint import export
    out = export(args.checkpoint, args.out, tag=args.tag)
    print(f"wrote {out}")
    return 0


def cmd_plugins(args, overrides) -> int:
    from zeroplug.registry import get_plugin_manager
    pm = get_plugin_manager()
    for row in pm.describe():
        print(f"{row['name']} {row['version']}")
        print(f"    provides: {', '.join(row['provides']) or '-'}")
        print(f"    hooks:    {', '.join(row['hooks'])}")
    return 0


def cmd_estimate(args, overrides) -> int:
    from zeroplug.observe.memory import GB
    from zeroplug.tools.probe import estimate_model_states
    act = None
    if args.activations_on_host and not args.micro_batch:
        raise ZeroplugError("--activations-on-host needs --micro-batch (a probe step measures the activations)")
    if args.seq is not None and not args.micro_batch:
        return _estimate_sequence(args)
    if args.params:
        if args.micro_batch:
            raise ZeroplugError("--micro-batch measures a model's activations: give --model, not --params")
        n = int(float(args.params))
    else:
        from zeroplug.tools.probe import estimate_inputs
        n, act, seq = estimate_inputs(args.model, args.micro_batch, args.seq, args.device)
    print(f"{'model states' if act is None else 'memory'} per rank for {n:,} parameters, world size "
          f"{args.world_size}, {'fp32' if args.param_bytes == 4 else '16-bit'} parameters (Adam):")
    act_device, act_host = act.split(args.activations_on_host) if act is not None else (0.0, 0.0)
    if act is not None:
        print(f"activations: {act.total / GB:.3f} GiB per rank for micro batch {args.micro_batch} x sequence "
              f"{seq} ({act.how}); of them, the checkpointed blocks' inputs {act.checkpointed / GB:.3f} GiB")
        print(f"  {act_device / GB:.3f} GiB in the device column"
              + (f", {act_host / GB:.3f} GiB in the host column ([activation_checkpointing] plugin = \"cpu\")"
                 if args.activations_on_host else
                 " (--activations-on-host: the checkpointed blocks' inputs in host memory)" if act.checkpointed
                 else ""))
    print(f"{'stage':>6} {'offload':>16} {'device GiB':>11} {'host GiB':>9}   device by category (GiB; "
          "engine.memory_report()'s names, gradients as at the step)")
    from zeroplug.quantized_states import STATE_DTYPES
    forms = STATE_DTYPES if args.state_dtype == "all" else (args.state_dtype,)
    for stage in (0, 1, 2, 3):
        for off_opt, off_par in ((False, False), (True, False), (True, True)):
            if off_par and stage < 3:
                continue
            for form in forms if off_opt else ("fp32",):
                e = estimate_model_states(n, stage, args.world_size, args.param_bytes, off_opt, off_par,
                                          act_device, act_host, form)
                label = ("param+optim" if off_par else "optim" if off_opt else "none") + \
                    (f"/{form}" if form != "fp32" else "")
                cats = " | ".join(f"{k} {v / GB:.2f}" for k, v in e["device_categories"].items() if v)
                print(f"{stage:>6} {label:>16} {e['device'] / GB:>11.2f} {e['host'] / GB:>9.2f}   {cats or '-'}")
    if len(forms) > 1:
        print("optim/bf16, optim/int8: the offloaded optimizer's Adam moments held in bf16 or block-quantised "
              "int8 (optimizer.state_dtype; host bytes per parameter for the states: 8, 4, 2.03)")
    return 0


def _estimate_sequence(args) -> int:
    """``zeroplug estimate --seq N`` without --micro-batch: a long sequence's activations from the
    model's shape, and the mechanisms it needs (zeroplug.tools.sequence)."""
    import torch

    from zeroplug.observe.memory import GB, host_available_bytes
    from zeroplug.tools.probe import load_spec
    from zeroplug.tools.sequence import Shape, report
    if args.params:
        raise ZeroplugError("--seq estimates a model's activations from its shape: give --model, not --params")
    if args.seq < 1 or args.sequence_parallel_size < 1:
        raise ZeroplugError("--seq and --sequence-parallel-size must be at least 1")
    spec = load_spec(args.model)
    n = spec.num_params()
    grown = 0
    if not spec.hf and spec.max_seq and args.seq > spec.max_seq:
        # Note: the reference GPT learns one position embedding per position
        grown = (args.seq - spec.max_seq) * Shape.of(spec).d_model
        n += grown
    if args.device_gib:
        device = args.device_gib * GB
    elif args.device != "cpu" and torch.cuda.is_available():
        device = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    else:
        device = 80 * GB
    host = (args.host_gib * GB if args.host_gib else host_available_bytes())
    form = "int8" if args.state_dtype == "all" else args.state_dtype
    from zeroplug.quantized_states import state_bytes
    # Note: stage 3 with both tiers on the host, gathered from the masters (stage3_params_from_masters):
    # the fp32 master, the gradient (bf16 on one rank, where that is exact; fp32 with several) and
    # Adam's moments, per element of this rank's shard
    grad = args.param_bytes if args.world_size == 1 else 4
    states = n * (4 + grad + state_bytes(form)) / args.world_size
    layers = spec.n_layer or 1
    working = 2 * n / layers * args.param_bytes        # two blocks gathered (the running one, the next)
    lines, last = report(spec, args.seq, 1, args.param_bytes, device, host - states,
                         args.sequence_parallel_size, working)
    print(f"{spec.name}: {n:,} parameters; stage 3 with both tiers on the host, gathered from the masters "
          f"({form} optimizer states): {states / GB:.1f} GiB of states on the host per rank")
    for line in lines:
        print(line)
    if grown:
        print(f"note: {grown:,} of the parameters are the position embeddings of the {args.seq - spec.max_seq:,} "
              f"positions past the preset's {spec.max_seq:,} (the reference GPT learns one per position; "
              f"zeroplug train --seq {args.seq} builds them)")
    return 0


def cmd_convert(args, overrides) -> int:
    import json

    from zeroplug.convert import convert_text
    p = Path(args.file)
    if not p.is_file():     # a FIFO or a device is never read
        raise ZeroplugError(f"{args.file}: {'not a regular file' if p.exists() else 'no such file'}")
    try:
        ds = json.loads(p.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ZeroplugError(f"{args.file}: not valid JSON: {exc}") from None
    except RecursionError:
        raise ZeroplugError(f"{args.file}: not valid JSON: nested more deeply than a config can be") from None
    try:
        print(convert_text(ds), end="")
    except ZeroplugError as exc:
        raise ZeroplugError(f"{args.file}: {exc}") from None
    return 0


def cmd_docs(args, overrides) -> int:
    if args.deepspeed_api:
        from zeroplug.deepspeed.surface import api_markdown
        print(api_markdown())
        return 0
    if args.deepspeed:
        from zeroplug.convert.keys import compat_markdown
        print(compat_markdown())
        return 0
    from zeroplug.config import CORE_TABLES, SLOT_TABLES
    from zeroplug.cli.reference import option_docs
    from zeroplug.registry import PluginManager, get_plugin_manager
    pm = get_plugin_manager() if args.installed else PluginManager(builtin_only=True)
    out = ["# Configuration reference", "",
           "Generated by `zeroplug docs` from the options each built-in plugin declares (`zeroplug docs",
           "--installed` adds the plugins of installed packages). One rule: each slot is a table with a",
           "`plugin` key naming who fills it; the other keys are that plugin's options. Precedence:",
           "command line (`--section.key=value`) > file > defaults; a command line that names another",
           "plugin for a table leaves out the file's keys of that table which the new plugin does not",
           "take (`--scheduler.plugin=none` over a file's warm-up keys), with a note.", ""]

    def table(title, cls):
        out.extend([f"### {title}", "", (cls.__doc__ or "").strip().split("\n")[0], "",
                    "| key | type | default | meaning |", "| --- | --- | --- | --- |"])
        out.extend(f"| `{n}` | {t} | `{d}` | {h} |" for n, t, d, h in option_docs(cls))
        out.append("")
    out.append("## Core tables\n")
    out.append("`[aio]` (DeepSpeed's name) gives defaults for the nvme tier's I/O keys (`block_size`, "
               "`queue_depth`, `thread_count` / `intra_op_parallelism`, `single_submit`, `overlap_events`) "
               "in both `[offload.optimizer]` and `[offload.param]`; keys set in those tables win. See "
               "plugin \"nvme\" below.\n")
    for name, cls in CORE_TABLES.items():
        table(f"[{name}]", cls)
    done = set()
    for path, (slot, default) in SLOT_TABLES.items():
        if slot in done:
            continue
        done.add(slot)
        paths = [p for p, (s, _) in SLOT_TABLES.items() if s == slot]
        out.append(f"## [{'] / ['.join(paths)}] — slot `{slot}` (default plugin: `{default}`)\n")
        for name in pm.names(slot):
            impl = pm.registry()[slot][name].impl
            out.append(f"#### plugin = \"{name}\" — {(impl.__doc__ or '').strip().splitlines()[0]}\n")
            opts = option_docs(impl.Options)
            if opts:
                out.extend(["| key | type | default | meaning |", "| --- | --- | --- | --- |"])
                out.extend(f"| `{n}` | {t} | `{d}` | {h} |" for n, t, d, h in opts)
            else:
                out.append("No options.")
            out.append("")
    print("\n".join(out))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one ``error:`` line (exit 2) like every other, not
    the usage block; its subcommands' parsers are of this class too."""

    def error(self, message):
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zeroplug", description="Plugin-based ZeRO training for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True)
    from zeroplug.registry import command_plugin_manager
    command_plugin_manager().hook.zeroplug_add_commands(subparsers=sub)    # train: the workload plugin
    x = sub.add_parser("export", help="write a checkpoint's consolidated model state dict (.pt or .safetensors)")
    x.add_argument("checkpoint", help="a checkpoint directory (its 'latest' tag) or one tag's directory")
    x.add_argument("out", help="output file (.safetensors, or .pt / .bin for torch.save's format) or a directory")
    x.add_argument("--tag", help="the tag to export (default: latest)")
    x.add_argument("--dtype", choices=["model", "fp32"], default="model",
                   help="model: the parameters as trained (16-bit with bf16/fp16); fp32: the fp32 master weights "
                        "(DeepSpeed's zero_to_fp32), written one tensor at a time. A DeepSpeed ZeRO checkpoint "
                        "directory works too")
    x.add_argument("--format", choices=["safetensors", "bin"],
                   help="output format when OUT is a directory (default safetensors: model.safetensors; bin: "
                        "pytorch_model.bin); a file's suffix decides otherwise")
    x.add_argument("--max-shard-size", help="OUT a directory: cut into shards of at most this size (e.g. 5GB) "
                                            "with Hugging Face's *.index.json")
    x.set_defaults(fn=cmd_export)
    sub.add_parser("plugins", help="list plugins, their versions, hooks and implementations").set_defaults(
        fn=cmd_plugins)
    e = sub.add_parser("estimate", help="model-state (and, with --micro-batch, activation) memory per rank "
                                        "for each stage and offload")
    e.add_argument("--model", default="1.3B",
                   help="a model preset (default 1.3B), a Hugging Face config.json, or module:function")
    e.add_argument("--params", help="parameter count instead of a preset, e.g. 6.7e9")
    e.add_argument("--world-size", type=int, default=1)
    e.add_argument("--param-bytes", type=int, default=2, choices=[2, 4])
    e.add_argument("--micro-batch", type=int, help="measure the activations of this micro batch (a probe step)")
    e.add_argument("--seq", type=int, help="with --micro-batch: the probe's sequence length (default 1024, or the "
                                           "model's longest if shorter); alone: a long sequence's activations from "
                                           "the model's shape (micro batch 1) and which of tiles, checkpoints on the "
                                           "host and sequence parallelism it needs to fit the device")
    e.add_argument("--sequence-parallel-size", type=int, default=1,
                   help="with --seq: ranks sharing each sequence (the estimate tries larger ones if needed)")
    e.add_argument("--device-gib", type=float, help="with --seq: device memory per rank (default: this GPU's, "
                                                    "else 80)")
    e.add_argument("--host-gib", type=float, help="with --seq: host memory (default: what is available now)")
    e.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"], help="where the probe runs")
    e.add_argument("--activations-on-host", action="store_true",
                   help="count the checkpointed blocks' inputs in host memory, as [activation_checkpointing] "
                        "plugin = \"cpu\" keeps them (with --micro-batch)")
    e.add_argument("--state-dtype", default="all", choices=["fp32", "bf16", "int8", "all"],
                   help="the offloaded optimizer's states (optimizer.state_dtype); all (default): a row for each")
    e.set_defaults(fn=cmd_estimate)
    from zeroplug.tools import report, tune
    tune.add_parser(sub)             # the commands' logic lives in zeroplug.tools, outside the core
    report.add_parser(sub)
    for name in ("launch", "deepspeed"):
        sub.add_parser(name, help="the `deepspeed` launcher's command line (--num_gpus, --hostfile, --include, "
                                  "...) run by torchrun; see `zeroplug launch --help`", add_help=False)
    c = sub.add_parser("convert", help="print a DeepSpeed JSON config as zeroplug TOML")
    c.add_argument("file")
    c.set_defaults(fn=cmd_convert)
    d = sub.add_parser("docs", help="print the configuration reference (markdown)")
    d.add_argument("--deepspeed", action="store_true",
                   help="print the DeepSpeed key table instead (docs/deepspeed-compat.md)")
    d.add_argument("--installed", action="store_true",
                   help="document the plugins of every installed package too, not only the built-in ones")
    d.add_argument("--deepspeed-api", action="store_true",
                   help="print the zeroplug.deepspeed name table instead (docs/deepspeed-api.md)")
    d.set_defaults(fn=cmd_docs)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("launch", "deepspeed"):     # the script's own arguments follow: no parsing here
        from zeroplug.deepspeed.launcher.runner import main as launch
        return launch(argv[1:])
    overrides, rest = _split_overrides(argv)
    try:
        args = build_parser().parse_args(rest)
    except SystemExit as exc:       # --help (0) or an argparse error, already printed (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.fn(args, overrides)
    except ZeroplugError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:
        from zeroplug.observe.memory import memory_available
        print(f"error: out of host memory ({exc or 'MemoryError'}){memory_available()}: use a smaller model, "
              "more ranks, or offload less", file=sys.stderr)
        return 2
    except RecursionError:
        print("error: an input is nested more deeply than it can be (RecursionError)", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from zeroplug.observe.memory import allocation_failure, memory_available
        line = allocation_failure(exc)
        if line is None:
            raise
        print(f"error: out of host memory: {line}{memory_available()}: use a smaller model (--model), more ranks, "
              "or offload less", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
