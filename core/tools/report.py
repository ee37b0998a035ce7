"""``zeroplug report RUN``: one PNG of a run, from the CSV monitor's file or TensorBoard events.

Four panels: training loss with the held-out loss; tokens/s; GPU memory (allocated, peak)
and host RSS; and a stacked bar per reported step of where its time went (forward,
backward, waiting for gradients, optimizer, between steps). matplotlib is an optional
extra (``zeroplug[plot]``), and reading event files needs ``zeroplug[tensorboard]``; both
are imported only here.
"""
from __future__ import annotations

import csv
import math
import statistics
import sys
from pathlib import Path

from zeroplug.errors import ZeroplugError

GiB = 1024 ** 3
PHASE_LABELS = {   # the engine's phases (zeroplug.observe.phases.PHASES), as a reader names them
    "forward": "forward",
    "backward": "backward",
    "wait_gradients": "waiting for gradients (reductions, offload copies)",
    "optimizer": "optimizer step (incl. swap waits)",
    "other": "between steps (data, evaluation)",
}
PHASE_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "wait_gradients": "#C44E52",
                "optimizer": "#55A868", "other": "#B0B0B0"}
_BYTES = {"mem_allocated", "max_mem_allocated", "host_rss"}
#: TensorBoard tag -> the CSV column it carries (memory tags are in GiB, CSV columns in bytes)
_TAGS = {"Train/loss": "loss", "Train/lr": "lr", "Train/loss_scale": "loss_scale",
         "Train/grad_norm": "grad_norm", "Train/samples_per_sec": "samples_per_sec",
         "Train/tokens_per_sec": "tokens_per_sec", "Memory/allocated_GiB": "mem_allocated",
         "Memory/max_allocated_GiB": "max_mem_allocated", "Memory/host_rss_GiB": "host_rss",
         "Eval/loss": "eval_loss"}

Series = dict[str, list[tuple[int, float]]]


MAX_STEP = 1 << 53


def read_csv(path: Path) -> Series:
    """Every non-empty numeric cell as (step, value), by column; memory in GiB. The CSV
    monitor appends: when the steps start again from a lower one, the last run is read.
    Rows that are not metrics (binary data, a field larger than the csv module takes, a step
    that is not a finite whole number, non-finite values) are skipped, and counted in one
    warning."""
    out: Series = {}
    last = -1
    skipped, first_bad = 0, None
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.DictReader(f)
        try:
            fields = reader.fieldnames
        except csv.Error:
            fields = None
        if not fields or "step" not in fields:
            raise ZeroplugError(f"{path}: not a zeroplug metrics CSV (no 'step' column); write one "
                                "with [monitor] plugin = \"csv\"")
        while True:
            try:
                row = next(reader)
            except StopIteration:
                break
            except csv.Error as exc:        # NUL bytes, a field over csv.field_size_limit(), ...
                skipped += 1
                first_bad = first_bad or f"line {reader.line_num}: {exc}"
                continue
            try:
                x = float(row["step"])
                step = int(x) if math.isfinite(x) and 0 <= x <= MAX_STEP and x == int(x) else None
            except (TypeError, ValueError):
                step = None
            if step is None:
                if row.get("step") not in (None, ""):
                    skipped += 1
                    first_bad = first_bad or f"line {reader.line_num}: step {str(row['step'])[:40]!r}"
                continue
            if step < last:       # a new run appended to the same file
                out = {}
            last = step
            for key, cell in row.items():
                if key in (None, "step") or cell in (None, ""):
                    continue
                try:
                    value = float(cell)
                except ValueError:
                    continue
                if not math.isfinite(value):
                    continue
                out.setdefault(key, []).append((step, value / GiB if key in _BYTES else value))
    if skipped:
        print(f"warning: {path}: skipped {skipped} row(s) that are not metrics (first: {first_bad})",
              file=sys.stderr)
    return out


def read_events(path: Path) -> Series:
    """The scalars of one run's TensorBoard event files (a file, or the directory holding them)."""
    files = [path] if path.is_file() else sorted(path.rglob("events.out.tfevents.*"))
    dirs = sorted({f.parent for f in files})
    if not files:
        raise ZeroplugError(f"{path}: no TensorBoard event files (events.out.tfevents.*) in it")
    if len(dirs) > 1:
        raise ZeroplugError(f"{path} holds {len(dirs)} runs ({', '.join(str(d) for d in dirs[:4])}); "
                            "name one of them")
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise ZeroplugError('reading TensorBoard event files needs the tensorboard package: '
                            'pip install "zeroplug[tensorboard]"') from None
    acc = EventAccumulator(str(path if path.is_file() else dirs[0]), size_guidance={"scalars": 0})
    acc.Reload()
    out: Series = {}
    for tag in acc.Tags().get("scalars", []):
        key = _TAGS.get(tag) or (f"phase_{tag.split('/', 1)[1]}" if tag.startswith("Phases/") else tag)
        out[key] = sorted((int(e.step), float(e.value)) for e in acc.Scalars(tag))
    return out


def read_run(path) -> Series:
    p = Path(path)
    if not p.exists():
        raise ZeroplugError(f"{path}: no such file or directory; give the CSV monitor's file "
                            "(monitor.path) or a TensorBoard run directory (output_path/job_name)")
    series = read_csv(p) if p.is_file() and p.suffix.lower() == ".csv" else read_events(p)
    if not series.get("loss") and not series.get("tokens_per_sec"):
        raise ZeroplugError(f"{path}: holds no training metrics yet (no loss, no tokens/s rows)")
    return series


def _xy(points):
    return [s for s, _ in points], [v for _, v in points]


def _phase_names(series: Series) -> list[str]:
    found = [k[len("phase_"):] for k in series if k.startswith("phase_")]
    return [p for p in PHASE_LABELS if p in found] + sorted(p for p in found if p not in PHASE_LABELS)


def draw(series: Series, out: Path, title: str) -> Path:
    """Write the four-panel PNG of ``series`` to ``out``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ZeroplugError('zeroplug report needs matplotlib: pip install "zeroplug[plot]"') from None
    fig = Figure(figsize=(13, 8.5), dpi=100)
    FigureCanvasAgg(fig)
    (ax_loss, ax_tps), (ax_mem, ax_ph) = fig.subplots(2, 2)

    loss, held = series.get("loss", []), series.get("eval_loss", [])
    if loss:
        ax_loss.plot(*_xy(loss), color="#4C72B0", lw=1.5, label="training loss")
    if held:
        ax_loss.plot(*_xy(held), color="#C44E52", lw=1.5, marker="o", ms=4, label="held-out loss")
    ax_loss.set(title="Loss", xlabel="step", ylabel="loss (nats per token)")
    ax_loss.legend(loc="upper right", frameon=False)

    tps = series.get("tokens_per_sec", [])
    if tps:
        xs, ys = _xy(tps)
        ax_tps.plot(xs, ys, color="#55A868", lw=1.5, marker=".", label="tokens/s")
        steady = ys[2:] if len(ys) > 4 else ys          # the first reports include warm-up
        med = statistics.median(steady)
        ax_tps.axhline(med, color="#555555", ls="--", lw=1, label=f"median {med:,.0f}")
        ax_tps.legend(loc="best", frameon=True, framealpha=0.8)
        ax_tps.set_ylim(bottom=0)
    ax_tps.set(title="Throughput", xlabel="step", ylabel="tokens per second")

    gpu_peak, gpu_now, host = (series.get(k, []) for k in ("max_mem_allocated", "mem_allocated", "host_rss"))
    if any(v > 0 for _, v in gpu_peak + gpu_now):
        ax_mem.plot(*_xy(gpu_peak), color="#C44E52", lw=1.5, label="GPU peak allocated")
        ax_mem.plot(*_xy(gpu_now), color="#DD8452", lw=1.5, label="GPU allocated")
    else:
        ax_mem.text(0.5, 0.5, "no GPU memory (a CPU run)", transform=ax_mem.transAxes, ha="center",
                    color="#555555")
    if host:
        ax_mem.plot(*_xy(host), color="#4C72B0", lw=1.5, label="host RSS")
    ax_mem.set(title="Memory", xlabel="step", ylabel="GiB")
    ax_mem.set_ylim(bottom=0)
    ax_mem.legend(loc="lower right", frameon=False)

    phases = _phase_names(series)
    if phases:
        steps = sorted({s for p in phases for s, _ in series[f"phase_{p}"]})
        width = 0.8 * (statistics.median(b - a for a, b in zip(steps, steps[1:])) if len(steps) > 1 else 1)
        bottom = [0.0] * len(steps)
        totals = {}
        warm = 1 if len(steps) >= 3 else 0        # the first report is the warm-up step
        for p in phases:
            vals = dict(series[f"phase_{p}"])
            ys = [vals.get(s, 0.0) for s in steps]
            totals[p] = sum(ys[warm:])
            ax_ph.bar(steps, ys, width, bottom=bottom, color=PHASE_COLORS.get(p), label=PHASE_LABELS.get(p, p))
            bottom = [b + y for b, y in zip(bottom, ys)]
        ax_ph.set_xlim(max(0.0, steps[0] - width), steps[-1] + width)     # not below step 0
        whole = sum(totals.values()) or 1.0
        handles, labels = ax_ph.get_legend_handles_labels()
        labels = [f"{lab}: {100 * totals[p] / whole:.0f}%" for lab, p in zip(labels, phases)]
        ax_ph.legend(handles[::-1], labels[::-1], loc="upper right", frameon=False, fontsize=8)
        ax_ph.set_ylim(0, max(bottom) * 1.6)
    else:
        ax_ph.text(0.02, 0.95, "no phase timings in this run", transform=ax_ph.transAxes, va="top")
    ax_ph.set(title="Where a step's time goes (shares after the first step)", xlabel="step",
              ylabel="seconds")

    for ax in (ax_loss, ax_tps, ax_mem, ax_ph):
        ax.grid(alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def summary(series: Series) -> str:
    parts = []
    if series.get("loss"):
        steps = series["loss"][-1][0]
        parts.append(f"{steps} steps, loss {series['loss'][0][1]:.3f} -> {series['loss'][-1][1]:.3f}")
    held = series.get("eval_loss", [])
    if len(held) > 1:
        parts.append(f"held-out {held[0][1]:.3f} -> {held[-1][1]:.3f}")
    tps = [v for _, v in series.get("tokens_per_sec", []) if math.isfinite(v)]
    if tps:
        parts.append(f"median {statistics.median(tps[2:] if len(tps) > 4 else tps):,.0f} tokens/s")
    return "; ".join(parts)


def report(run, out=None, title=None) -> Path:
    """Read ``run`` (CSV file or TensorBoard run) and draw it; returns the PNG's path."""
    series = read_run(run)
    p = Path(run)
    target = Path(out) if out else (p.with_suffix(".png") if p.is_file() else p.parent / f"{p.name}.png")
    return draw(series, target, title or f"zeroplug run {p.name}: {summary(series)}")


def cmd_report(args) -> int:
    path = report(args.run, args.out, args.title)
    print(f"wrote {path}")
    return 0


def add_parser(sub) -> None:
    r = sub.add_parser("report", help="draw one PNG of a run from its CSV monitor file or TensorBoard events")
    r.add_argument("run", help="the CSV monitor's file, or a TensorBoard run directory (or event file)")
    r.add_argument("-o", "--output", "--out", dest="out", help="the PNG to write (default: next to RUN, RUN's name with .png)")
    r.add_argument("--title", help="the picture's title (default: the run's name and a summary)")
    r.set_defaults(fn=lambda args, overrides: cmd_report(args))
