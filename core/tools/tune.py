"""``zeroplug tune``: which ZeRO stage and offload to use for a model on this machine.

1. Read the machine: the device and its free memory, the host's available memory, the free
   space at ``--nvme-path``.
2. Measure the model's activation memory for the batch with a probe step
   (:mod:`zeroplug.tools.probe`) and estimate each candidate's device, host and disk bytes
   (model states by the ZeRO accounting of :mod:`zeroplug.observe.memory`, plus the activations).
3. Run a few steps of each candidate that fits, most promising first (seed 001's order:
   everything on the device, then the optimizer on the CPU, then the parameters too, then
   NVMe). Once a tier has run, only the first candidate of the next tier is tried; when it
   is slower than the best so far, the slower tiers are skipped.
4. Write the fastest as a commented ``zero.toml`` with the table of what was tried.

One process, one device: run it without torchrun.
"""
from __future__ import annotations

import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from zeroplug.errors import ZeroplugError

if TYPE_CHECKING:
    import torch

GiB = 1024 ** 3
#: the usable share of free memory or disk in the estimates (allocator slack, buffers)
HEADROOM = 0.95
_CPU, _NVME = "cpu", "nvme"
SUB_GROUP = 100_000_000       # offloaded runs on a GPU: reduce_bucket_size and sub_group_size


@dataclass
class Candidate:
    tier: int
    stage: int
    optimizer: str = "none"      # where the optimizer states live: none (the device) | cpu | nvme
    param: str = "none"          # stage 3's parameters: none | cpu | nvme
    activations: str = "none"    # the checkpointed blocks' inputs: none (the device) | cpu
    est_device: float = 0.0
    est_host: float = 0.0
    est_disk: float = 0.0
    run: object = None           # zeroplug.benchmarking.measure.StepRun
    verdict: str = ""
    states: str = "fp32"         # the offloaded optimizer's Adam moments (optimizer.state_dtype)

    @property
    def name(self) -> str:
        where = {(_CPU, "none"): " + optimizer on CPU", (_CPU, _CPU): " + optimizer and parameters on CPU",
                 (_NVME, "none"): " + optimizer on NVMe", (_NVME, _CPU): " + optimizer on NVMe, parameters on CPU",
                 (_NVME, _NVME): " + optimizer and parameters on NVMe"}
        acts = " + activations on CPU" if self.activations == _CPU else ""
        small = f" ({self.states} states)" if self.states != "fp32" else ""
        return f"stage{self.stage}" + where.get((self.optimizer, self.param), "") + acts + small

    @property
    def tokens_per_s(self) -> float:
        return self.run.tokens_per_s if self.run is not None and self.run.error is None else 0.0


#: a candidate must beat the one chosen so far by more than this, or by more than the two
#: runs' own step-to-step spread if that is larger, to replace it (a few timed steps on a
#: busy machine differ by more than the stages do)
MIN_MARGIN = 0.03


def spread(run) -> float:
    """(slowest - fastest) / median of a run's timed steps; 0 with fewer than two."""
    t = run.step_times if run is not None else []
    return (max(t) - min(t)) / statistics.median(t) if len(t) > 1 else 0.0


def clearly_faster(c: Candidate, best: Candidate | None) -> bool:
    """Whether ``c`` beats ``best`` by more than the noise of their measurements."""
    if best is None:
        return True
    margin = max(MIN_MARGIN, spread(c.run), spread(best.run))
    return c.tokens_per_s > best.tokens_per_s * (1 + margin)


TIERS = (  # most promising first; tier = what leaves the device
    [Candidate(0, s) for s in (0, 1, 2, 3)],
    [Candidate(1, 2, _CPU), Candidate(1, 3, _CPU)],
    [Candidate(2, 3, _CPU, _CPU)],
    [Candidate(3, 3, _NVME, _CPU)],
    [Candidate(4, 3, _NVME, _NVME)],
)


@dataclass
class Machine:
    device: torch.device
    device_name: str
    device_free: float          # bytes usable on the device now
    host_available: float
    nvme_path: str | None
    disk_free: float

    def describe(self) -> str:
        dev = (f"{self.device_name}, {self.device_free / GiB:.1f} GiB free" if self.device.type == "cuda"
               else "the CPU (no CUDA device)")
        disk = (f"; {self.nvme_path}: {self.disk_free / GiB:.1f} GiB free" if self.nvme_path
                else "; no --nvme-path (NVMe candidates not considered)")
        return f"{dev}; host {self.host_available / GiB:.1f} GiB available{disk}"


def read_machine(device: torch.device, nvme_path: str | None) -> Machine:
    import torch

    from zeroplug.observe.memory import host_available_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
    else:
        free, name = 0, "cpu"
    disk = 0.0
    if nvme_path:
        os.makedirs(nvme_path, exist_ok=True)
        disk = float(shutil.disk_usage(nvme_path).free)
    return Machine(device, name, float(free), float(host_available_bytes()), nvme_path, disk)


def config_for(c: Candidate, micro_batch: int, machine: Machine, lr: float, measuring: bool) -> dict:
    cfg = {"batch": {"micro_batch_size": micro_batch, "gradient_clipping": 1.0},
           "zero": {"plugin": f"stage{c.stage}"},
           "precision": {"plugin": "bf16" if machine.device.type == "cuda" else "fp32"},
           "optimizer": {"plugin": "auto", "lr": lr}}
    if c.states != "fp32":
        cfg["optimizer"]["state_dtype"] = c.states
    if c.optimizer != "none":
        cfg["offload"] = {"optimizer": {"plugin": c.optimizer}}
        if c.param != "none":
            cfg["offload"]["param"] = {"plugin": c.param}
        for table in cfg["offload"].values():
            if table["plugin"] == _NVME:
                table["nvme_path"] = machine.nvme_path
        if machine.device.type == "cuda":    # what docs/benchmarks.md's offloaded rows measured
            cfg["zero"].update(reduce_bucket_size=SUB_GROUP, sub_group_size=SUB_GROUP)
    if c.activations != "none":
        cfg["activation_checkpointing"] = {"plugin": c.activations}
    if measuring:
        cfg["batch"]["steps_per_print"] = 1      # the engine's phase timings on every step
        cfg["monitor"] = {"plugin": "none"}
    return cfg


def estimate(c: Candidate, n_params: int, activations, machine: Machine) -> None:
    """Fill ``c``'s estimated device, host and disk bytes (``activations``: a
    :class:`zeroplug.tools.probe.Activations`)."""
    from zeroplug.quantized_states import state_bytes

    from .probe import estimate_model_states
    param_bytes = 2 if machine.device.type == "cuda" else 4
    on_device, on_host = activations.split(c.activations == _CPU)
    e = estimate_model_states(n_params, c.stage, 1, param_bytes, c.optimizer != "none", c.param != "none",
                              on_device, on_host, c.states)
    c.est_device, c.est_host, c.est_disk = e["device"], e["host"], 0.0
    host = e["host_categories"]
    if c.optimizer == _NVME:       # the states go to disk; up to 3 sub-groups in flight stay in memory
        sub_group = SUB_GROUP if machine.device.type == "cuda" else 1_000_000_000
        optim = host.get("master", 0.0) + host.get("optimizer", 0.0)
        c.est_disk += optim
        c.est_host += 3 * min(sub_group, n_params) * (8 + state_bytes(c.states)) - optim
    if c.param == _NVME:
        c.est_disk += host.get("lp_params", 0.0)
        c.est_host -= host.get("lp_params", 0.0)


def smaller_states(c: Candidate, n_params: int, activations, machine: Machine, why: str) -> str | None:
    """An offloaded candidate that does not fit with fp32 Adam moments: the first smaller form
    (bf16, then int8: optimizer.state_dtype) with which it fits, set on ``c``; else ``why``."""
    if "host memory" not in why and "on disk" not in why:
        return why              # the GPU or no --nvme-path: the states' form does not help
    for form in ("bf16", "int8"):
        c.states = form
        estimate(c, n_params, activations, machine)
        if reject_reason(c, machine) is None:
            return None
    c.states = "fp32"
    estimate(c, n_params, activations, machine)
    return why


def reject_reason(c: Candidate, machine: Machine) -> str | None:
    """Why ``c`` cannot run here, or None."""
    if machine.device.type == "cpu" and _CPU in (c.optimizer, c.param):
        return "the device is the CPU: offloading to CPU memory moves nothing"
    if _NVME in (c.optimizer, c.param) and not machine.nvme_path:
        return "no --nvme-path given"
    if machine.device.type == "cuda" and c.est_device > HEADROOM * machine.device_free:
        return (f"estimated {c.est_device / GiB:.1f} GiB on the GPU > {HEADROOM * machine.device_free / GiB:.1f} "
                "GiB usable")
    host_need = c.est_host + (c.est_device if machine.device.type == "cpu" else 0.0)
    if host_need > HEADROOM * machine.host_available:
        return (f"estimated {host_need / GiB:.1f} GiB of host memory > "
                f"{HEADROOM * machine.host_available / GiB:.1f} GiB usable")
    if c.est_disk > HEADROOM * machine.disk_free:
        return f"estimated {c.est_disk / GiB:.1f} GiB on disk > {machine.disk_free / GiB:.1f} GiB free"
    return None


def with_activations_on_host(c: Candidate, n_params: int, activations, machine: Machine) -> Candidate | None:
    """The same candidate with the checkpointed blocks' inputs in host memory, when ``c`` was
    rejected for the GPU's memory and the model checkpoints activations; else None."""
    if (machine.device.type != "cuda" or c.activations != "none" or not activations.checkpointed
            or c.est_device <= HEADROOM * machine.device_free):
        return None
    v = Candidate(c.tier, c.stage, c.optimizer, c.param, activations=_CPU)
    estimate(v, n_params, activations, machine)
    return v


@dataclass
class TuneResult:
    model: str
    n_params: int
    micro_batch: int
    seq: int
    activations: object           # zeroplug.tools.probe.Activations
    machine: Machine
    candidates: list[Candidate] = field(default_factory=list)
    best: Candidate | None = None
    seconds: float = 0.0
    steps: int = 0
    warmup: int = 0
    lr: float = 1e-4


def tune(spec, micro_batch: int, seq: int, device: torch.device, nvme_path: str | None = None,
         steps: int = 3, warmup: int = 2, max_candidates: int = 8, lr: float = 1e-4,
         activation_bytes: float | None = None, log=print) -> TuneResult:
    import torch

    from zeroplug.benchmarking.measure import run_steps
    from zeroplug.tools.probe import Activations, measure_activations
    t0 = time.perf_counter()
    machine = read_machine(device, nvme_path)
    n_params = spec.num_params()
    log(f"tune: {spec.name}, {n_params:,} parameters, micro batch {micro_batch} x sequence {seq}")
    log(f"tune: machine: {machine.describe()}")
    if activation_bytes is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        acts = measure_activations(spec, micro_batch, seq, device, dtype)
    else:
        acts = Activations(activation_bytes, how="given with --activations-gib")
    log(f"tune: activations {acts.total / GiB:.2f} GiB ({acts.how}); the checkpointed blocks' inputs "
        f"{acts.checkpointed / GiB:.2f} GiB of them (on the host when the GPU is short)")
    result = TuneResult(spec.name, n_params, micro_batch, seq, acts, machine, steps=steps, warmup=warmup, lr=lr)
    build = spec.build
    make_batch = spec.make_batch(micro_batch, seq)
    best, stop, tried = None, None, 0

    def candidates(proto):
        c = Candidate(proto.tier, proto.stage, proto.optimizer, proto.param)
        estimate(c, n_params, acts, machine)
        yield c
        # Note: only where the GPU's memory is what rejects it: a candidate that fits runs
        # faster with its activations on the device
        v = with_activations_on_host(c, n_params, acts, machine)
        if v is not None:
            yield v

    for tier in TIERS:
        for c in (c for proto in tier for c in candidates(proto)):
            result.candidates.append(c)
            why = reject_reason(c, machine)
            if why and c.optimizer != "none":
                why = smaller_states(c, n_params, acts, machine, why)
            if why:
                c.verdict = f"rejected: {why}"
                continue
            if stop:
                c.verdict = f"not tried: {stop}"
                continue
            if tried >= max_candidates:
                c.verdict = f"not tried: --max-candidates {max_candidates} reached"
                continue
            tried += 1
            log(f"tune: [{tried}] {c.name}: estimated {c.est_device / GiB:.1f} GiB device, "
                f"{c.est_host / GiB:.1f} GiB host; running {warmup} + {steps} steps")
            c.run = run_steps(lambda: build(None), make_batch, config_for(c, micro_batch, machine, lr, True),
                              steps=steps, warmup=warmup, device=device, label=c.name, on_error=True)
            if c.run.error:
                c.verdict = f"rejected: {c.run.error}"
                log(f"tune:     failed: {c.run.error}")
                continue
            log(f"tune:     {c.tokens_per_s:,.0f} tokens/s, peak GPU {c.run.peak_gpu_bytes / GiB:.1f} GiB, "
                f"peak host {c.run.peak_host_bytes / GiB:.1f} GiB")
            if best is not None and best.tier < c.tier and c.tokens_per_s <= best.tokens_per_s:
                stop = (f"{c.name} ran at {c.tokens_per_s / best.tokens_per_s:.2f}x {best.name}; "
                        "slower tiers skipped")
            if clearly_faster(c, best):
                best = c
    for c in result.candidates:
        if c.run is not None and c.run.error is None:
            ratio = c.tokens_per_s / best.tokens_per_s
            if c is best:
                c.verdict = "chosen: the fastest beyond the steps' noise"
            elif ratio > 1:
                c.verdict = (f"ran: {ratio:.2f}x the chosen, within its steps' noise "
                             f"({max(MIN_MARGIN, spread(c.run), spread(best.run)):.0%}): the earlier candidate kept")
            else:
                c.verdict = f"ran: {ratio:.2f}x the chosen"
    result.best = best
    result.seconds = time.perf_counter() - t0
    return result


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def render(result: TuneResult, command: str) -> str:
    """The commented zero.toml of the chosen candidate."""
    from zeroplug.convert import to_toml
    m, a = result.machine, result.activations
    lines = [f"# Chosen by `{command}` in {result.seconds:.0f} s.",
             f"# Machine: {m.describe()}.",
             f"# Model {result.model}: {result.n_params:,} parameters; micro batch {result.micro_batch} x "
             f"sequence {result.seq}; activations {a.total / GiB:.2f} GiB ({a.how}).",
             f"# Each candidate ran {result.warmup} warm-up + {result.steps} timed steps (tokens/s of the median "
             "step); peaks are this process's.",
             f"# A later candidate replaces an earlier one only when faster by more than the steps' spread "
             f"(at least {MIN_MARGIN:.0%}).",
             "#",
             "# Memory in GiB: estimated (device, host) before running, then the measured peaks.",
             f"# {'candidate':<46} {'est. dev':>8} {'est. host':>9} {'tokens/s':>9} {'peak GPU':>8} "
             f"{'peak host':>9}  result"]
    for c in result.candidates:
        ran = c.run is not None and c.run.error is None
        tps = f"{c.tokens_per_s:,.0f}" if ran else "-"
        gpu = _gib(c.run.peak_gpu_bytes) if ran else "-"
        host = _gib(c.run.peak_host_bytes) if ran else "-"
        lines.append(f"# {c.name:<46} {_gib(c.est_device):>8} {_gib(c.est_host):>9} {tps:>9} {gpu:>8} "
                     f"{host:>9}  {c.verdict}")
    lines.append("#")
    if result.best is None:
        lines.append("# No candidate ran: see the reasons above.")
        return "\n".join(lines) + "\n"
    best = result.best
    lines += [f"# Chosen: {best.name}, {best.tokens_per_s:,.0f} tokens/s. Set your own learning rate and "
              "schedule below.", ""]
    return "\n".join(lines) + "\n" + to_toml(config_for(best, result.micro_batch, m, result.lr, False))


def cmd_tune(args) -> int:
    import shlex
    import sys

    import torch

    from zeroplug.tools.probe import load_spec
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ZeroplugError("zeroplug tune measures on one process and one device; run it without torchrun "
                            "(for N ranks' memory: zeroplug estimate --world-size N)")
    if args.micro_batch < 1 or (args.seq is not None and args.seq < 1) or args.steps < 1 or args.warmup < 0:
        raise ZeroplugError("--micro-batch, --seq and --steps must be at least 1 (--warmup at least 0)")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ZeroplugError("--device cuda: no CUDA device is visible; use --device cpu")
    out = Path(args.out)
    try:     # checked before the minutes of tuning, not after
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ZeroplugError(f"--out {out}: cannot create its directory ({exc.strerror or exc})") from None
    if not os.access(out.parent, os.W_OK):
        raise ZeroplugError(f"--out {out}: {out.parent} is not writable")
    spec = load_spec(args.model, not args.no_activation_checkpointing, args.vocab_size)
    seq = spec.seq_or_default(args.seq)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    result = tune(spec, args.micro_batch, seq, dev, args.nvme_path, args.steps, args.warmup,
                  args.max_candidates, args.lr,
                  None if args.activations_gib is None else args.activations_gib * GiB)
    command = "zeroplug " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["tune"] \
        else "zeroplug tune"
    text = render(result, command)
    tmp = out.with_name(out.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, out)
    except OSError as exc:
        raise ZeroplugError(f"--out {out}: cannot write it ({exc.strerror or exc})") from None
    print(text, end="")
    if result.best is None:
        print(f"error: no candidate ran on this machine (table in {out})", file=sys.stderr)
        return 1
    print(f"wrote {out}: {result.best.name}, {result.best.tokens_per_s:,.0f} tokens/s "
          f"(tuning took {result.seconds:.0f} s)")
    return 0


def add_parser(sub) -> None:
    t = sub.add_parser("tune", help="measure the stages and offloads that fit this machine; write the fastest "
                                    "as a commented zero.toml")
    t.add_argument("--model", required=True,
                   help="a model preset (e.g. 1.3B), a Hugging Face config.json, or module:function")
    t.add_argument("--micro-batch", type=int, default=8, help="micro batch per step (default 8)")
    t.add_argument("--seq", type=int, help="sequence length (default 1024, or the model's longest if shorter)")
    t.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"],
                   help="auto (default): cuda when present")
    t.add_argument("--nvme-path", help="a directory on a fast disk: NVMe candidates are considered")
    t.add_argument("--steps", type=int, default=3, help="timed steps per candidate (default 3)")
    t.add_argument("--warmup", type=int, default=2, help="warm-up steps per candidate (default 2)")
    t.add_argument("--max-candidates", type=int, default=8, help="run at most this many (default 8)")
    t.add_argument("--lr", type=float, default=1e-4, help="learning rate of the runs and the file (default 1e-4)")
    t.add_argument("-o", "--output", "--out", dest="out", default="zero.toml", help="where to write the chosen config (default zero.toml)")
    t.add_argument("--activations-gib", type=float, help="skip the probe: activation memory per micro-batch")
    t.add_argument("--vocab-size", type=int, help="token ids are drawn below this (module:function models "
                                                  "without config.vocab_size)")
    t.add_argument("--no-activation-checkpointing", action="store_true",
                   help="presets and Hugging Face configs: no activation checkpointing (default: on every "
                        "block, as the reference workload)")
    t.set_defaults(fn=lambda args, overrides: cmd_tune(args))
