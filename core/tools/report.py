"""``zeroplug report RUN``: one PNG of a run, from the CSV monitor's file, a ``zeroplug train``
run directory (its metrics.csv) or TensorBoard events.

Four panels: training loss with the held-out loss; tokens/s (samples/s for inputs without a
sequence dimension); GPU memory (allocated, peak) and host RSS; and a stacked bar per
reported step of where its time went (forward, backward, waiting for gradients, optimizer,
between steps). A CSV file that several runs appended to holds each of them (a run starts
where the steps start again from a lower one): all are drawn, one colour each, with the
phases of the last (``--run N``: that one alone). matplotlib is an optional extra
(``zeroplug[plot]``), and reading event files needs ``zeroplug[tensorboard]``; both are
imported only here.
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
#: the metrics file of a ``zeroplug train`` run directory, and the picture drawn beside it
RUN_METRICS, RUN_PICTURE = "metrics.csv", "report.png"
RUN_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")


def read_csv(path: Path) -> list[Series]:
    """Each run of the file: every non-empty numeric cell as (step, value), by column; memory
    in GiB. The CSV monitor appends: where the steps start again from a lower one, another
    run begins. Rows that are not metrics (binary data, a field larger than the csv module
    takes, a step that is not a finite whole number, non-finite values) are skipped, and
    counted in one warning."""
    runs: list[Series] = []
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
                runs.append(out)
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
    runs.append(out)
    return [r for r in runs if r]


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


def _source(path) -> Path:
    """The file or event directory to read: a run directory's metrics.csv, else ``path``."""
    p = Path(path)
    if not p.exists():
        raise ZeroplugError(f"{path}: no such file or directory; give a zeroplug train run directory (runs/...), "
                            "the CSV monitor's file (monitor.path) or a TensorBoard run directory "
                            "(output_path/job_name)")
    return p / RUN_METRICS if p.is_dir() and (p / RUN_METRICS).is_file() else p


def read_runs(path) -> list[Series]:
    """Every run that ``path`` holds (several where runs appended to one CSV file)."""
    p = _source(path)
    runs = read_csv(p) if p.is_file() and p.suffix.lower() == ".csv" else [read_events(p)]
    runs = [r for r in runs if r.get("loss") or r.get("tokens_per_sec") or r.get("samples_per_sec")]
    if not runs:
        raise ZeroplugError(f"{path}: holds no training metrics yet (no loss, no throughput rows)")
    return runs


def read_run(path, run: int | None = None) -> Series:
    """One run of ``path``: the ``run``-th (from 1), by default the last."""
    runs = read_runs(path)
    return runs[_pick(path, len(runs), run) - 1]


def _pick(path, found: int, run: int | None) -> int:
    if run is None:
        return found
    if not 1 <= run <= found:
        raise ZeroplugError(f"--run {run}: {path} holds {found} run{'s' if found > 1 else ''}; give 1 to {found}")
    return run


def _xy(points):
    return [s for s, _ in points], [v for _, v in points]


def _phase_names(series: Series) -> list[str]:
    found = [k[len("phase_"):] for k in series if k.startswith("phase_")]
    return [p for p in PHASE_LABELS if p in found] + sorted(p for p in found if p not in PHASE_LABELS)


def _throughput(runs: list[Series]) -> tuple[str, str]:
    """The throughput column to draw: tokens/s where the runs have it, else samples/s."""
    if any(r.get("tokens_per_sec") for r in runs):
        return "tokens_per_sec", "tokens"
    return "samples_per_sec", "samples"


def draw(runs, out: Path, title: str, labels: list[str] | None = None) -> Path:
    """Write the four-panel PNG of ``runs`` (one Series, or several: one colour each, the
    phases of the last) to ``out``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ZeroplugError('zeroplug report needs matplotlib: pip install "zeroplug[plot]"') from None
    runs = [runs] if isinstance(runs, dict) else list(runs)
    single = len(runs) == 1
    labels = labels or [f"run {i + 1}" for i in range(len(runs))]
    fig = Figure(figsize=(13, 8.5), dpi=100)
    FigureCanvasAgg(fig)
    (ax_loss, ax_tps), (ax_mem, ax_ph) = fig.subplots(2, 2)

    def named(i: int, what: str) -> str:
        return what if single else f"{labels[i]}: {what}"

    for i, series in enumerate(runs):
        color = RUN_COLORS[i % len(RUN_COLORS)]
        loss, held = series.get("loss", []), series.get("eval_loss", [])
        if loss:
            ax_loss.plot(*_xy(loss), color="#4C72B0" if single else color, lw=1.5, label=named(i, "training loss"))
        if held:
            ax_loss.plot(*_xy(held), color="#C44E52" if single else color, lw=1.5, marker="o", ms=4,
                         ls="-" if single else "--", label=named(i, "held-out loss"))
    ax_loss.set(title="Loss", xlabel="step", ylabel="loss (nats per token)")
    if ax_loss.get_legend_handles_labels()[0]:
        ax_loss.legend(loc="upper right", frameon=False, fontsize=10 if single else 8)

    key, unit = _throughput(runs)
    for i, series in enumerate(runs):
        pts = series.get(key, [])
        if not pts:
            continue
        xs, ys = _xy(pts)
        color = "#55A868" if single else RUN_COLORS[i % len(RUN_COLORS)]
        ax_tps.plot(xs, ys, color=color, lw=1.5, marker=".", label=named(i, f"{unit}/s"))
        steady = ys[2:] if len(ys) > 4 else ys          # the first reports include warm-up
        med = statistics.median(steady)
        ax_tps.axhline(med, color="#555555" if single else color, ls="--", lw=1,
                       label=named(i, f"median {med:,.0f}"))
    if any(r.get(key) for r in runs):
        ax_tps.legend(loc="best", frameon=True, framealpha=0.8, fontsize=10 if single else 8)
        ax_tps.set_ylim(bottom=0)
    ax_tps.set(title="Throughput", xlabel="step", ylabel=f"{unit} per second")

    gpu = False
    for i, series in enumerate(runs):
        gpu_peak, gpu_now, host = (series.get(k, []) for k in ("max_mem_allocated", "mem_allocated", "host_rss"))
        if any(v > 0 for _, v in gpu_peak + gpu_now):
            gpu = True
            ax_mem.plot(*_xy(gpu_peak), color="#C44E52" if single else RUN_COLORS[i % len(RUN_COLORS)], lw=1.5,
                        label=named(i, "GPU peak allocated"))
            ax_mem.plot(*_xy(gpu_now), color="#DD8452" if single else RUN_COLORS[i % len(RUN_COLORS)], lw=1,
                        ls="-" if single else ":", label=named(i, "GPU allocated"))
        if host:
            ax_mem.plot(*_xy(host), color="#4C72B0" if single else RUN_COLORS[i % len(RUN_COLORS)], lw=1.5,
                        ls="-" if single else "-.", label=named(i, "host RSS"))
    if not gpu:
        ax_mem.text(0.5, 0.5, "no GPU memory (a CPU run)", transform=ax_mem.transAxes, ha="center",
                    color="#555555")
    ax_mem.set(title="Memory", xlabel="step", ylabel="GiB")
    ax_mem.set_ylim(bottom=0)
    if ax_mem.get_legend_handles_labels()[0]:
        ax_mem.legend(loc="lower right", frameon=False, fontsize=10 if single else 8)

    series = runs[-1]
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
        handles, names = ax_ph.get_legend_handles_labels()
        names = [f"{lab}: {100 * totals[p] / whole:.0f}%" for lab, p in zip(names, phases)]
        ax_ph.legend(handles[::-1], names[::-1], loc="upper right", frameon=False, fontsize=8)
        ax_ph.set_ylim(0, max(bottom) * 1.6)
    else:
        ax_ph.text(0.02, 0.95, "no phase timings in this run", transform=ax_ph.transAxes, va="top")
    ax_ph.set(title="Where a step's time goes (shares after the first step)" + ("" if single else f", {labels[-1]}"),
              xlabel="step", ylabel="seconds")

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
    key, unit = _throughput([series])
    rates = [v for _, v in series.get(key, []) if math.isfinite(v)]
    if rates:
        parts.append(f"median {statistics.median(rates[2:] if len(rates) > 4 else rates):,.0f} {unit}/s")
    return "; ".join(parts)


def report(run, out=None, title=None, which: int | None = None) -> Path:
    """Read ``run`` (a run directory, a CSV file or a TensorBoard run) and draw it: every run
    the file holds, or the ``which``-th (from 1). Returns the PNG's path."""
    return report_runs(run, out, title, which)[0]


def report_runs(run, out=None, title=None, which: int | None = None) -> tuple[Path, int]:
    """:func:`report`, and how many runs ``run`` holds."""
    runs = read_runs(run)
    p, src = Path(run), _source(run)
    if src != p:        # a zeroplug train run directory
        target = Path(out) if out else p / RUN_PICTURE
    else:
        target = Path(out) if out else (p.with_suffix(".png") if p.is_file() else p.parent / f"{p.name}.png")
    name = p.resolve().name if src != p else p.name
    if which is not None:
        picked = _pick(run, len(runs), which)
        drawn, labels = [runs[picked - 1]], [f"run {picked}"]
        auto = f"zeroplug run {name}" + (f" (run {picked} of {len(runs)})" if len(runs) > 1 else "")
    else:
        drawn, labels = runs, [f"run {i + 1}" for i in range(len(runs))]
        auto = f"zeroplug run {name}" + (f" ({len(runs)} runs; the last)" if len(runs) > 1 else "")
    return draw(drawn, target, title or f"{auto}: {summary(drawn[-1])}", labels), len(runs)


def cmd_report(args) -> int:
    path, found = report_runs(args.run, args.out, args.title, args.which)
    if found > 1:
        what = f"drew run {args.which}" if args.which is not None else "drew each (--run N draws one)"
        print(f"found {found} runs in {_source(args.run)}: {what}")
    print(f"wrote {path}")
    return 0


def add_parser(sub) -> None:
    r = sub.add_parser("report", help="draw one PNG of a run from its run directory, CSV monitor file or "
                                      "TensorBoard events")
    r.add_argument("run", help="a zeroplug train run directory (runs/...), the CSV monitor's file, or a "
                               "TensorBoard run directory (or event file)")
    r.add_argument("-o", "--output", "--out", dest="out",
                   help="the PNG to write (default: a run directory's report.png; else next to RUN, RUN's name "
                        "with .png)")
    r.add_argument("--title", help="the picture's title (default: the run's name and a summary)")
    r.add_argument("--run", dest="which", type=int, metavar="N",
                   help="a CSV file that several runs appended to: draw the N-th (from 1) alone (default: each)")
    r.set_defaults(fn=lambda args, overrides: cmd_report(args))
