"""The schedule's length from ``zeroplug train --steps``."""
from __future__ import annotations


def fit_schedule(given: dict, steps: int, source, overrides, pm) -> tuple[dict, list[str], dict]:
    """The config with the schedule's length taken from ``steps`` where it is "auto" or not set,
    and a warm-up that would not fit such a run shortened; the lines to print and the comments
    for config.toml. A length the config sets itself wins, with a line that says so."""
    import copy

    from zeroplug.config import SLOT_TABLES
    from zeroplug.options import AUTO, fields_of
    table = given.get("scheduler")
    name = table.get("plugin", SLOT_TABLES["scheduler"][1]) if isinstance(table, dict) else SLOT_TABLES["scheduler"][1]
    reg = pm.registry().get("scheduler", {}).get(name) if isinstance(name, str) else None
    if reg is None:             # resolve names the unknown plugin
        return given, [], {}
    fields = fields_of(reg.impl.Options)
    raw = copy.deepcopy(given)
    t = raw.setdefault("scheduler", {}) if "total_num_steps" in fields or "warmup_num_steps" in fields else {}
    lines, comments = [], {}
    follows = "warmup_num_steps" in fields          # warm-up bounded by the run (WarmupLR has no length)
    # a DeepSpeed config's "auto" arrives translated to a number: the launcher's length is --steps here
    translated = getattr(given, "translation", None)
    ds_auto = translated is not None and any(k == "scheduler.total_num_steps" for _, k, _ in translated.autos)
    if "total_num_steps" in fields:
        total = t.get("total_num_steps", AUTO)
        if total == AUTO or ds_auto:
            t["total_num_steps"] = steps
            comments["scheduler.total_num_steps"] = f"{steps} in this run (its --steps)"
        else:
            follows = False
            if isinstance(total, int) and not isinstance(total, bool) and total != steps:
                where = ("the command line" if any(o.startswith("--scheduler.total_num_steps=") for o in overrides)
                         else str(source))
                lines.append(f"note: scheduler.total_num_steps = {total} ({where}) sets the schedule's length, not "
                             f"--steps {steps}: " + (f"the run stops {total - steps} steps before the lr's decay ends"
                                                     if total > steps else
                                                     f"the lr stays at its final value from step {total} on")
                             + "; set it to \"auto\" to follow --steps")
    if follows:
        f = fields["warmup_num_steps"][0]
        warm = t.get("warmup_num_steps", f.default)
        short = max(1, steps // 10)
        if isinstance(warm, int) and not isinstance(warm, bool) and warm >= steps and warm > short:
            t["warmup_num_steps"] = short
            lines.append(f"note: scheduler.warmup_num_steps = {warm} does not fit --steps {steps}: the warm-up is "
                         f"shortened to {short} step{'s' if short > 1 else ''} (a tenth of the run)")
            comments["scheduler.warmup_num_steps"] = f"{short} in this run (shortened to fit --steps {steps})"
    return raw, lines, comments
