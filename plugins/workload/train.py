"""``zeroplug train``: the built-in GPT (:mod:`.models`) on a byte corpus (:mod:`.data`),
through the public API, with checkpoints, resume and a held-out loss before and after.

Config precedence: command line (``--section.key=value``) > file > defaults.
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import zeroplug

from zeroplug.errors import StepFailedError, ZeroplugError

from . import rundir
from .rundir import NO_SAVE_ENV
from .schedule import fit_schedule

#: the packaged default configuration (what ``zeroplug train`` reads without --config or ./zero.toml)
DEFAULT_CONFIG = Path(zeroplug.__file__).with_name("zero.toml")




def add_parser(sub) -> None:
    t = sub.add_parser("train", help="train the built-in GPT on a text corpus (default: the stdlib's sources)",
                       epilog="Any --section.key=value overrides the config, e.g. --zero.plugin=stage2. "
                              "The run is written to runs/<date>-<time>-<model>/ (see --run-dir).")
    t.add_argument("--config", help="TOML (or DeepSpeed JSON) config; default: ./zero.toml, else the packaged one")
    t.add_argument("--steps", type=int, help="optimizer steps (default 300; with --resume RUN: the run's). They set "
                                             "the schedule's length where scheduler.total_num_steps is \"auto\" "
                                             "(the packaged zero.toml) or not set")
    t.add_argument("--data", help="train on this text file instead of the stdlib corpus")
    t.add_argument("--device", choices=["cpu", "cuda", "auto"],
                   help="cpu (default), cuda, or auto (cuda when present)")
    from .presets import PRESETS
    t.add_argument("--model", choices=list(PRESETS), metavar="PRESET",
                   help=f"model preset: {', '.join(PRESETS)} (default char-tiny: byte-level, 0.8 M "
                        "parameters; the others are GPT-2-style sizes with a 50,304 vocabulary)")
    t.add_argument("--seq", type=int, help="sequence length (default: the preset's; a longer one adds position "
                                          "embeddings; with [sequence] plugin = \"ulysses\" each sequence is "
                                          "sliced over sequence_parallel_size ranks and tiled)")
    t.add_argument("--activation-checkpointing", action="store_true", default=None,
                   help="checkpoint every block (its activations are recomputed in the backward); on by itself "
                        "when [activation_checkpointing] picks a store other than \"none\" (e.g. "
                        "--activation_checkpointing.plugin=cpu: the blocks' inputs wait in host memory)")
    t.add_argument("--seed", type=int, help="seeds the model's initial weights and the batch order (default 0)")
    t.add_argument("--max-bytes", type=int, default=None, help="cap the corpus size")
    t.add_argument("--collective-timeout", type=float, metavar="SECONDS",
                   help="under torchrun: a collective that waits this long for another rank fails and "
                        "ends the job (default: torch's, 30 min for gloo, 10 for NCCL)")
    t.add_argument("--async-save", action="store_true",
                   help="write each checkpoint in the background while training goes on (the same as "
                        "--checkpoint.async_save=true; docs/reliability.md)")
    t.add_argument("--run-dir", "--output-dir", dest="run_dir", metavar="DIR",
                   help="where the run is written (default runs/<date>-<time>-<model>/): its resolved config "
                        "(config.toml), one CSV row per step (metrics.csv), the final checkpoint (checkpoints/) "
                        "and zeroplug report's picture (report.png)")
    t.add_argument("--no-save", action="store_true",
                   help=f"write no run directory (scripts and test suites; {NO_SAVE_ENV}=1 makes it the default)")
    t.add_argument("--resume", nargs="?", const="latest", metavar="RUN|auto|TAG",
                   help="RUN: continue the run in that directory (its config, model and data; --steps N trains "
                        "it to step N). Without a run directory: from the checkpoint that [checkpoint] dir's "
                        "'latest' names (if there is one); =auto: or, if that one is missing or corrupt, from "
                        "the newest that verifies; =TAG: from that one")
    t.set_defaults(fn=cmd_train)


class Progress:
    """A one-line progress bar on a terminal; a plain line every 10% otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.t0 = total, enabled, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.last_pct = -1

    def update(self, done: int, loss: float | None) -> None:
        if not self.enabled:
            return
        el = time.perf_counter() - self.t0
        eta = el / done * (self.total - done) if done else 0.0
        frac = done / self.total
        loss_s = f" loss {loss:.3f}" if loss is not None else ""
        if self.tty:
            bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
            end = "\n" if done == self.total else ""
            print(f"\r[{bar}] {done}/{self.total}{loss_s} {el:.0f}s eta {eta:.0f}s", end=end,
                  file=sys.stderr, flush=True)
        elif int(frac * 10) > self.last_pct:
            self.last_pct = int(frac * 10)
            print(f"progress {done}/{self.total} ({frac:.0%}){loss_s} elapsed {el:.0f}s eta {eta:.0f}s",
                  file=sys.stderr, flush=True)


def _read_config_file(path):
    """The config at ``path`` as a raw dict; a file that is not text is named as such."""
    from zeroplug import config as config_mod
    p = Path(path)
    if p.is_dir():
        raise ZeroplugError(f"--config {str(p)!r} is a directory: pass a TOML file or a DeepSpeed JSON file")
    if p.is_file():     # not a FIFO or a device: read_file refuses those without reading
        data = p.read_bytes()
        bad = [i for i in (data.find(b"\0"),) if i >= 0]
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad.append(exc.start)
        if bad:
            bad = min(bad)
            raise ZeroplugError(f"--config {str(p)!r} is not a text file (binary data at byte {bad}): pass a "
                                f"TOML file or a DeepSpeed JSON file")
    try:
        return config_mod.read_file(p)
    except RecursionError:
        raise ZeroplugError(f"--config {str(p)!r}: nested more deeply than a config can be") from None


def _check_train_args(args) -> None:
    for flag, value, example in (("--steps", args.steps, 300), ("--seq", args.seq, 128),
                                 ("--max-bytes", args.max_bytes, 1000000),
                                 ("--collective-timeout", args.collective_timeout, 600)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ZeroplugError(f"{flag} {value}: must be a positive number (e.g. {flag} {example})")


def _summary(cfg) -> str:
    """Every slot's chosen plugin, offload tiers included (``zero=stage2 offload.optimizer=cpu ...``)."""
    return " ".join(f"{path}={choice.name}" for path, choice in cfg.slots.items())


def _attach_csv(engine, path: Path):
    """The run's metrics.csv: the "csv" monitor beside the configured one, for this engine's
    life. None (with a note) where no plugin provides it."""
    from zeroplug.options import build_options
    reg = engine.plugin_manager.registry().get("monitor", {}).get("csv")
    if reg is None:
        if engine.run.rank == 0:
            print(f"note: no \"csv\" monitor is loaded (ZEROPLUG_PLUGINS_BLOCK?): {path} is not written", flush=True)
        return None
    monitor = reg.impl(build_options(reg.impl.Options, {"path": str(path)}, "monitor"), engine.run)
    engine.plugin_manager.attach(monitor, RUN_MONITOR)
    engine.monitors.append(monitor)     # the engine records every step's readings for it
    return monitor


#: the plugin-manager name of the run directory's CSV monitor
RUN_MONITOR = "zeroplug-train-run-csv"


def cmd_train(args, overrides) -> int:
    resumed, saved_args, saving = rundir.plan(args)
    _check_train_args(args)         # before torch's import: a mistyped number fails at once
    # Note: the largest models fit only when freed blocks can be regrown in place; without
    # expandable segments the caching allocator's fragmentation cost a 4.9B model its last GiB
    # on the H100 (docs/benchmarks.md, "Peak GPU memory beside PyTorch FSDP2"). Read at the first
    # CUDA allocation; a user's setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    from zeroplug import config as config_mod
    from zeroplug.checkpoint import directory as checkpoint_dir
    from zeroplug.engine import initialize, make_run
    from zeroplug.observe.memory import allocation_failure, memory_available
    from zeroplug.registry import get_plugin_manager

    from .data import ByteBatches, load_text, min_corpus_bytes, stdlib_corpus
    from .models import GPT, get_preset

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ZeroplugError("--device cuda: no CUDA device is visible; use --device cpu")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_distributed_from_env(device, args.collective_timeout)
    if resumed is not None:
        cfg_path = resumed / rundir.CONFIG
    else:
        cfg_path = args.config or (Path("zero.toml") if Path("zero.toml").is_file() else DEFAULT_CONFIG)
    raw = _read_config_file(cfg_path)
    if device == "cuda" and "precision" not in raw and not any(o.startswith("--precision.") for o in overrides):
        overrides = ["--precision.plugin=bf16", *overrides]       # the GPU default
    if args.async_save:
        overrides = [*overrides, "--checkpoint.async_save=true"]
    pm = get_plugin_manager()
    given = config_mod.apply_overrides(raw, overrides, pm)     # what the file and the command line set
    fitted, schedule_lines, schedule_comments = fit_schedule(given, args.steps, cfg_path, overrides, pm)
    cfg, run, _ = make_run(fitted, device=device)
    rank, world = run.rank, run.world_size
    ck = cfg.checkpoint
    if args.resume and resumed is None and not ck.dir:
        raise ZeroplugError("--resume needs a run directory (--resume runs/<run>) or a checkpoint directory "
                            "([checkpoint] dir, e.g. --checkpoint.dir=ckpt)")

    try:
        if args.data:
            corpus, source = load_text(args.data), args.data
        else:
            corpus, source = stdlib_corpus(max_bytes=args.max_bytes), "the Python standard library's sources"
        mcfg = get_preset(args.model, activation_checkpointing=args.activation_checkpointing
                          or cfg.slot("activation_checkpointing").name != "none")
    except (OSError, KeyError, ValueError) as exc:
        raise ZeroplugError(exc.args[0] if isinstance(exc, KeyError) else str(exc)) from None
    if args.seq is not None and args.seq > mcfg.seq_len:
        mcfg = mcfg.with_(seq_len=args.seq)     # the reference GPT learns one embedding per position
    seq = args.seq or mcfg.seq_len
    if len(corpus) < min_corpus_bytes(seq):
        what = f"--data {args.data!r}" if args.data else "the corpus (--max-bytes)"
        raise ZeroplugError(f"{what}: {len(corpus):,} bytes is too small for one training window of {seq + 1} "
                            f"bytes plus a held-out part of one window: give at least {min_corpus_bytes(seq):,} "
                            f"bytes of text, or a shorter --seq")

    run_dir, error = None, None
    if saving and rank == 0:
        try:
            run_dir = resumed or rundir.claim(Path(args.run_dir) if args.run_dir else None, args.model)
        except ZeroplugError as exc:
            error = str(exc)
    run_dir, error = run.comm.broadcast_object((run_dir, error), src=0)
    if error is not None:
        raise ZeroplugError(error)
    ck_dir = ck.dir or (str(run_dir / rundir.CHECKPOINTS) if run_dir is not None else "")
    if rank == 0:
        where = f"run {run_dir} | " if run_dir is not None else ""
        print(f"zeroplug train: {where}config {cfg_path} | {_summary(cfg)} | world_size={world} device={device} "
              f"micro_batch={cfg.batch.micro_batch_size} accumulation={cfg.batch.gradient_accumulation_steps}",
              flush=True)
        for line in schedule_lines:
            print(line, flush=True)
    fresh = run_dir is not None and resumed is None and args.run_dir is None
    try:
        if ck_dir:      # checked and locked before any training that a bad directory would lose
            checkpoint_dir.hold_on_rank0(run.comm, ck_dir, args)
        torch.manual_seed(args.seed)
        try:
            model = GPT(mcfg)
            engine = initialize(model, cfg, device=device)
        except RuntimeError as exc:
            line = allocation_failure(exc)
            if line is None:
                raise
            raise ZeroplugError(f"--model {args.model} does not fit this host's memory ({line})"
                                f"{memory_available()}: use a smaller --model, more ranks, or offload less") from None
    except BaseException:
        if fresh and rank == 0 and not any(run_dir.iterdir()):
            run_dir.rmdir()             # a run that never started leaves no directory
        raise
    if run_dir is not None:
        if rank == 0:
            rundir.write_start(run_dir, given, cfg, schedule_comments, args, cfg_path, overrides, world, saved_args)
        _attach_csv(engine, run_dir / rundir.METRICS)
    sp = engine.sequence()      # the ranks of a sequence group read the same windows, each trains its slice
    data = ByteBatches(corpus, cfg.batch.micro_batch_size, seq, seed=args.seed, rank=sp.group.data_parallel_rank,
                       world_size=sp.group.data_parallel_size, device=device)
    if rank == 0:
        print(f"model {args.model}: {sum(p.numel() for p in model.parameters()):,} parameters; "
              f"data: {len(corpus):,} bytes of {source}", flush=True)

    def eval_loss() -> float:
        engine.eval()
        with torch.no_grad():
            x, y = data.eval_batch(max(1, min(64, 65536 // seq)))     # 64 windows up to 1,024 tokens
            b = sp.shard({"idx": x, "targets": y})
            loss = engine(b["idx"], b["targets"], b.get("position_ids")).float().item()
        engine.train()
        return loss

    start = 0
    if args.resume:
        got = _resume(engine, ck_dir, "auto" if resumed is not None else args.resume)
        if got is not None:
            path, client = got
            start = int(client.get("step", 0))
            if "data" in client:
                data.load_state_dict(client["data"])
            if rank == 0:
                print(f"resumed from {path} at step {start}", flush=True)
        elif rank == 0:
            print(f"--resume: no checkpoint in {ck_dir} yet; starting at step 0", flush=True)
    if start >= args.steps and rank == 0:
        print(f"the run is at step {start} already (--steps {args.steps}): nothing to train; --steps N with N > "
              f"{start} trains it further", flush=True)

    def save(done: int) -> None:
        path = engine.save_checkpoint(ck_dir, client_state={"step": done, "data": data.state_dict()})
        if rank == 0 and not progress.tty:
            later = " (being written in the background)" if engine.background_saves.in_flight() else ""
            print(f"checkpoint {path}{later}", file=sys.stderr, flush=True)

    def log_eval(step: int, loss: float) -> None:     # held-out loss for monitors (csv, tensorboard)
        for m in engine.monitors:
            m.write_eval({"step": step, "eval_loss": loss})

    start_eval = eval_loss()
    log_eval(start, start_eval)
    eval_every = max(1, args.steps // 10)
    progress = Progress(args.steps, enabled=rank == 0)
    first = last = None
    gas = cfg.batch.gradient_accumulation_steps
    saved = start
    periodic = bool(ck_dir and ck.every_n_steps)
    try:
        for step in range(start, args.steps):
            total = 0.0
            for _ in range(gas):
                x, y = next(data)
                b = sp.shard({"idx": x, "targets": y})      # this rank's slice (the whole, on one rank)
                loss = engine(b["idx"], b["targets"], b.get("position_ids"))
                engine.backward(loss)
                engine.step()
                total += loss.item() / gas
            first = total if first is None else first
            last = total
            progress.update(step + 1, total)
            if (step + 1) % eval_every == 0 and step + 1 < args.steps:
                log_eval(step + 1, eval_loss())
            if periodic and (step + 1) % ck.every_n_steps == 0:
                save(step + 1)
                saved = step + 1
        if (periodic or run_dir is not None) and saved < args.steps:      # the final checkpoint
            save(args.steps)
            saved = args.steps
    except ZeroplugError as exc:
        if engine.run.failed is None or isinstance(exc, StepFailedError):
            raise
        where = (f"the last checkpoint in {ck_dir} (step {saved}) with --resume" if ck_dir and saved
                 else "the start (no checkpoint was saved)")
        raise ZeroplugError(f"{exc} The step failed part-way, so nothing is saved from it; once fixed, "
                            f"continue from {where}") from None
    except RuntimeError as exc:
        if world == 1 or not _collective_failure(exc):
            raise
        first_line = str(exc).strip().splitlines()[0][-300:]
        raise ZeroplugError(f"rank {rank}: a collective with the other ranks failed ({first_line}): another rank "
                            f"died or stopped responding (torchrun's summary names it), so the job stops; "
                            f"continue from the last checkpoint with --resume") from None
    end_eval = eval_loss()
    log_eval(max(start, args.steps), end_eval)
    engine.close()
    engine.plugin_manager.detach(RUN_MONITOR)
    checkpoint_dir.release(args)
    if rank == 0 and first is not None:
        print(f"train loss: first step {first:.4f} -> last step {last:.4f}")
        print(f"held-out loss: start {start_eval:.4f} -> end {end_eval:.4f} "
              f"({'lower' if end_eval < start_eval else 'NOT lower'}; "
              f"{start_eval / math.log(2):.2f} -> {end_eval / math.log(2):.2f} bits per byte)")
    if rank == 0 and run_dir is not None:
        rundir.finish(run_dir, ck_dir, max(start, args.steps))
    return 0


def _collective_failure(exc: BaseException) -> bool:
    """An error of the process group: a peer gone (connection closed or reset) or silent (timeout)."""
    import torch.distributed as dist
    text = str(exc)
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        s in text for s in ("gloo", "NCCL", "Timed out", "Connection closed", "Connection reset"))


def _resume(engine, directory, choice):
    """``--resume`` (the checkpoint ``latest`` names), ``--resume=auto`` (that one, else the
    newest that verifies) or ``--resume=TAG``; None when the directory holds none yet."""
    from zeroplug.checkpoint import CheckpointError, resume
    if not directory:
        raise ZeroplugError("--resume needs a run directory (--resume runs/<run>) or a checkpoint directory "
                            "([checkpoint] dir, e.g. --checkpoint.dir=ckpt)")
    tag = None if choice in ("latest", "auto") else choice
    try:
        return resume(engine, directory, tag, fallback=choice == "auto")
    except CheckpointError as exc:
        newest = getattr(exc, "newest", None)
        hint = (f"; the newest checkpoint that verifies is {newest!r}: continue from it with --resume=auto "
                f"(or --resume={newest})" if newest else
                f"; no other checkpoint in {directory} verifies: start without --resume, or set another "
                f"checkpoint.dir" if hasattr(exc, "newest") else "")
        raise ZeroplugError(f"--resume: {exc}{hint}") from None


def init_distributed_from_env(device_type: str, timeout: float | None = None) -> bool:
    """Start the default process group if torchrun's variables are set; True if distributed.
    ``timeout`` (seconds): how long a collective waits for the other ranks before it fails
    (torch's default when None)."""
    from zeroplug.launch import start_process_group
    return start_process_group(device_type, timeout=timeout or None, announce=False)
