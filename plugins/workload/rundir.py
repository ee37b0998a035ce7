"""The directory a ``zeroplug train`` run leaves (``runs/<date>-<time>-<model>/`` by default):

* ``config.toml``: the configuration the run resolved, which ``--config`` reads again;
* ``run.json``: what the command line chose besides it (model, data, steps, ...), read by
  ``--resume RUN``;
* ``metrics.csv``: one row per step and per evaluation (the CSV monitor's format);
* ``checkpoints/``: the final checkpoint (and the periodic ones of ``[checkpoint]
  every_n_steps``), unless ``[checkpoint] dir`` names another directory;
* ``report.png``: ``zeroplug report``'s picture of ``metrics.csv``, drawn at the end.

No torch here: the command line checks a run directory before anything heavy loads.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

from zeroplug.errors import ZeroplugError

RUNS = Path("runs")
CONFIG, RUN, METRICS, CHECKPOINTS, PICTURE = "config.toml", "run.json", "metrics.csv", "checkpoints", "report.png"
#: set to 1: ``zeroplug train`` writes no run directory unless one is named (test suites, scripts)
NO_SAVE_ENV = "ZEROPLUG_NO_SAVE"
#: the command-line choices a run directory keeps (``--resume RUN`` takes them back), and what
#: ``zeroplug train`` does without the option (and without ``--resume RUN``)
DEFAULTS = {"model": "char-tiny", "seq": None, "data": None, "seed": 0, "max_bytes": None,
            "activation_checkpointing": False, "device": "cpu", "steps": 300}


def is_run(path) -> bool:
    return (Path(path) / RUN).is_file()


def claim(path: Path | None, model: str) -> Path:
    """The run directory, created: ``path``, which must not hold a run already, or a new
    ``runs/<date>-<time>-<model>`` (``-2``, ``-3``, ... when two runs start in one second)."""
    if path is not None:
        if is_run(path):
            raise ZeroplugError(f"--run-dir {str(path)!r} holds a run already: continue it with --resume {path} "
                                f"(and --steps N to train it further), or name another directory")
        if path.exists() and not path.is_dir():
            raise ZeroplugError(f"--run-dir {str(path)!r} is a file: name a directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ZeroplugError(f"--run-dir {str(path)!r}: cannot create it ({exc.strerror or exc}); name a "
                                "directory this user can write") from None
        return path
    stem = RUNS / f"{time.strftime('%Y%m%d-%H%M%S')}-{model}"
    for n in range(1, 1000):
        candidate = stem if n == 1 else stem.with_name(f"{stem.name}-{n}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue
        except OSError as exc:
            raise ZeroplugError(f"cannot create the run directory {str(candidate)!r} ({exc.strerror or exc}): run "
                                "from a directory this user can write, name one with --run-dir, or pass "
                                "--no-save") from None
    raise ZeroplugError(f"{RUNS}: too many runs named {stem.name}; name one with --run-dir")


def read_args(path: Path) -> dict:
    try:
        data = json.loads((path / RUN).read_text())
    except (OSError, ValueError) as exc:
        raise ZeroplugError(f"--resume {str(path)!r}: its {RUN} cannot be read ({exc}); start a new run") from None
    if not isinstance(data, dict) or not isinstance(data.get("args"), dict):
        raise ZeroplugError(f"--resume {str(path)!r}: its {RUN} is not a zeroplug run's; start a new run")
    return data


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


# --- the resolved configuration as TOML --------------------------------------------------------

def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if v != v else ("inf" if v > 0 else "-inf")
    if isinstance(v, float) and v.is_integer() and abs(v) >= 1000:
        return str(int(v))          # 5e8 sizes, written as the integers they are
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)            # a TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"{v!r} has no TOML form")


def _fields(options) -> dict:
    """Option name -> (value, aliases) of a validated options dataclass."""
    return {f.name: (getattr(options, f.name), tuple(f.metadata.get("alias", ()))) for f in dataclasses.fields(options)}


def _table(lines: list, path: str, given: dict, options, plugin: str | None, default_plugin: str | None,
           notes: dict) -> None:
    """One table: the keys the config set (as set, "auto" kept, with the value this run used
    beside it where that differs), then every other option as a comment, at the value this
    run used."""
    lines.append(f"[{path}]")
    fields = _fields(options) if options is not None else {}
    alias_of = {a: name for name, (_, aliases) in fields.items() for a in aliases}
    if default_plugin is not None:
        if "plugin" in given:
            lines.append(f"plugin = {_toml(given['plugin'])}")
        else:
            lines.append(f"# plugin = {_toml(plugin)}   (the default)")
    seen = set()
    for key, value in given.items():
        if key == "plugin" or isinstance(value, dict):
            continue
        name = alias_of.get(key, key)
        seen.add(name)
        line = f"{key} = {_toml(value)}"
        used = fields.get(name, (value,))[0]
        note = notes.get(f"{path}.{name}")
        if note:
            line += f"   # {note}"
        elif name in fields and _comparable(used) != _comparable(value):
            line += f"   # {_toml(used)} in this run"
        lines.append(line)
    for name, (value, _) in fields.items():
        if name not in seen and value is not None:
            note = notes.get(f"{path}.{name}")
            lines.append(f"# {name} = {_toml(value)}" + (f"   ({note})" if note else ""))
    lines.append("")


def _comparable(v):
    if isinstance(v, (list, tuple)):
        return [_comparable(x) for x in v]
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return v


def config_toml(given: dict, cfg, header: list[str], notes: dict, slot_tables: dict, core_tables: dict) -> str:
    """``given``: the raw config the file and the command line set (before the run filled
    anything in); ``cfg``: the validated config the run used; ``notes``: "table.key" -> a
    comment on a value the run decided (the schedule's length)."""
    lines = [f"# {h}" if h else "#" for h in header] + [""]
    for name in core_tables:
        _table(lines, name, given.get(name) or {}, getattr(cfg, name), None, None, notes)
    for path, (_, default) in slot_tables.items():
        node = given
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        choice = cfg.slot(path)
        _table(lines, path, node if isinstance(node, dict) else {}, choice.options, choice.name, default, notes)
    known = set(core_tables) | {p.split(".")[0] for p in slot_tables}
    for name, table in given.items():       # tables a plugin shares ([aio]): as set
        if name not in known and isinstance(table, dict):
            lines.append(f"[{name}]")
            lines.extend(f"{k} = {_toml(v)}" for k, v in table.items() if not isinstance(v, dict))
            lines.append("")
    return "\n".join(lines)


def plan(args) -> tuple[Path | None, dict | None, bool]:
    """(the run directory ``--resume`` continues, its run.json, whether this run is saved) from
    --resume, --run-dir and --no-save; ``args`` gets the run's choices (or the defaults) for the
    options not given."""
    resumed, saved_args = None, None
    if args.resume not in (None, "latest", "auto") and Path(args.resume).is_dir():
        if not is_run(args.resume):
            raise ZeroplugError(f"--resume {args.resume!r} is a directory but not a run's (no {RUN} in it): "
                                "name a run directory (runs/...) or a checkpoint tag of [checkpoint] dir "
                                "(use a plain name)")
        resumed = Path(args.resume)
        for flag, value in (("--config", args.config), ("--run-dir", args.run_dir), ("--no-save", args.no_save)):
            if value:
                raise ZeroplugError(f"--resume {args.resume} continues that run with its own config and directory: "
                                    f"drop {flag} (change a key with --section.key=value)")
        saved_args = read_args(resumed)
    if args.no_save and args.run_dir:
        raise ZeroplugError("--no-save and --run-dir contradict each other: keep one")
    for name, default in defaults(saved_args).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    saving = resumed is not None or args.run_dir is not None or not (
        args.no_save or os.environ.get(NO_SAVE_ENV, "").strip() not in ("", "0"))
    return resumed, saved_args, saving


def defaults(saved_args: dict | None) -> dict:
    """The value of each run option not given: the continued run's, else the default."""
    out = dict(DEFAULTS)
    if saved_args is not None:
        out.update({k: v for k, v in saved_args["args"].items() if k in DEFAULTS})
    return out


def write_start(run_dir: Path, given, cfg, comments, args, cfg_path, overrides, world, saved_args) -> None:
    """config.toml and run.json, at the start (a run stopped part-way keeps them)."""
    import zeroplug
    from zeroplug.config import CORE_TABLES, SLOT_TABLES
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    header = [f"zeroplug train's configuration of the run in {run_dir} ({now}),",
              f"from {cfg_path}" + (f" and the command line's {' '.join(overrides)}" if overrides else "") + ".",
              "Active lines: what the file and the command line set (\"auto\" kept, the value the run used",
              "beside it); commented lines: every other option, at the value the run used.",
              f"Continue the run: zeroplug train --resume {quote(run_dir)} --steps N",
              f"A new run from it: zeroplug train --config {quote(run_dir / CONFIG)}"]
    if not cfg.checkpoint.dir:
        comments = {**comments, "checkpoint.dir": f"this run: {CHECKPOINTS}/ here"}
    text = config_toml(given, cfg, header, comments, SLOT_TABLES, CORE_TABLES)
    (run_dir / CONFIG).write_text(text)
    choices = {k: getattr(args, k) for k in DEFAULTS}
    if choices["data"]:         # --resume from another directory finds it
        choices["data"] = str(Path(choices["data"]).resolve())
    record = {"zeroplug": zeroplug.__version__, "started": (saved_args or {}).get("started", now), "updated": now,
              "args": choices, "overrides": list(overrides), "config_source": str(cfg_path), "world_size": world}
    write_json(run_dir / RUN, record)


def finish(run_dir: Path, ck_dir: str, steps: int) -> None:
    """Draw the picture and end with where the run is, how to continue it and how to look at it."""
    from zeroplug.tools.report import report
    try:
        picture, missing = report(run_dir), None
    except ZeroplugError as exc:
        picture, missing = None, str(exc)
    inside = Path(ck_dir).resolve().is_relative_to(run_dir.resolve()) if ck_dir else False
    held = ["config.toml", "metrics.csv"] + ([f"{CHECKPOINTS}/"] if inside else []) + \
        (["report.png"] if picture else [])
    elsewhere = "" if inside else f"; checkpoints in {ck_dir}"
    q = quote(run_dir)
    print(f"run saved:   {run_dir}/ ({', '.join(held)}{elsewhere})")
    print(f"continue it: zeroplug train --resume {q} --steps {2 * steps}")
    if picture:
        print(f"look at it:  {picture} (zeroplug report {q} draws it again)")
    else:
        print(f"look at it:  zeroplug report {q} ({missing})")


def quote(path) -> str:
    import shlex
    return shlex.quote(str(path))
