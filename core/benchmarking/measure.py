"""One training step, measured: the engine (or plain PyTorch) over a user's model and batches.

A *runner* builds the model and its engine once, makes one step's micro-batches outside the
timed region, and runs forward + backward + optimizer step with the device synchronised at
both ends, so a step's wall time is the step's and nothing else's. :func:`run_steps` times
a few steps after warm-ups; the pytest fixture (``zeroplug.benchmarking``) hands the same
step to pytest-benchmark instead, so its statistics, ``--benchmark-json`` and
``--benchmark-compare`` apply.

Standalone: imports torch, the standard library and zeroplug's public surface.
"""
from __future__ import annotations

import gc
import inspect
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

log = logging.getLogger("zeroplug")

GiB = 1024 ** 3


# -- memory readings ----------------------------------------------------------------------

def reset_peak_host() -> bool:
    """Restart the kernel's count of this process's peak RSS (VmHWM); False where that is
    not possible (not Linux, or /proc/self/clear_refs not writable)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


def peak_host_bytes() -> int:
    """This process's peak RSS since the last :func:`reset_peak_host` (since start otherwise)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- results ----------------------------------------------------------------------------------

@dataclass
class StepRun:
    """What a few measured steps of one configuration gave."""
    label: str
    step_times: list[float] = field(default_factory=list)   # timed steps only (after warm-ups)
    tokens_per_step: int = 0
    peak_gpu_bytes: int = 0
    peak_host_bytes: int = 0
    losses: list[float] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # the engine's phase_* of the last step
    error: str | None = None

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_times) if self.step_times else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.median_s if self.step_times else float("nan")

    def extra_info(self) -> dict[str, Any]:
        """The JSON-ready fields that benchmarks record."""
        return {"tokens_per_s": round(self.tokens_per_s, 1), "step_s": round(self.median_s, 6),
                "tokens_per_step": self.tokens_per_step, "peak_gpu_bytes": self.peak_gpu_bytes,
                "peak_host_bytes": self.peak_host_bytes,
                "phases": {k: round(v, 6) for k, v in self.phases.items()}}


# -- runners ------------------------------------------------------------------------------------

def _call_batch(make_batch: Callable, device: torch.device):
    try:
        takes_device = bool(inspect.signature(make_batch).parameters)
    except (TypeError, ValueError):
        takes_device = True
    return make_batch(device) if takes_device else make_batch()


def loss_of(out) -> torch.Tensor:
    """A model's output as its loss: a tensor, or an object / dict with ``loss`` (Hugging Face)."""
    if torch.is_tensor(out):
        return out
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None:
        raise TypeError("the model's forward returned no loss: return a scalar tensor, or an output "
                        "with .loss (give a Hugging Face model its labels)")
    return loss


def batch_tokens(batch) -> int:
    """Tokens in one micro-batch: the elements of its first tensor (input ids, batch x seq)."""
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return int(first.numel()) if first.dim() >= 2 else int(first.shape[0])


def forward_batch(model, batch):
    """``model`` called on one micro-batch: a dict as keyword arguments, else positionally."""
    return model(**batch) if isinstance(batch, dict) else model(*batch)


class EngineRunner:
    """``build_model()`` trained by zeroplug under ``config`` on ``device``."""

    def __init__(self, build_model: Callable[[], torch.nn.Module], make_batch: Callable, config,
                 device=None, label: str = "zeroplug"):
        import zeroplug
        self.device = torch.device(device) if device is not None else default_device()
        self.make_batch, self.label = make_batch, label
        cfg = zeroplug.load_config(config) if not isinstance(config, zeroplug.Config) else config
        # Note: stage 3 builds the model already sharded (never whole on the device);
        # the lower stages build it on the device, so the host never holds an fp32 copy.
        if cfg.slot("zero").name == "stage3":
            with zeroplug.init(cfg, device=self.device):
                model = build_model()
        else:
            with torch.device(self.device):
                model = build_model()
        self.engine = zeroplug.initialize(model, cfg, device=self.device)
        self.accumulation = self.engine.gradient_accumulation_steps

    def batches(self) -> list:
        """One optimizer step's micro-batches, made on the device (outside the timing)."""
        out = [_call_batch(self.make_batch, self.device) for _ in range(self.accumulation)]
        sync(self.device)
        return out

    def step(self, batches) -> float:
        """Forward, backward and optimizer step over ``batches``; returns the mean loss."""
        losses = []
        for b in batches:
            loss = loss_of(forward_batch(self.engine, b))
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.detach())
        sync(self.device)
        return float(sum(x.float().item() for x in losses)) / len(losses)

    def phases(self) -> dict[str, float]:
        m = getattr(self.engine, "last_metrics", None) or {}
        return {k[len("phase_"):]: v for k, v in m.items() if k.startswith("phase_")}

    def close(self) -> None:
        self.engine.close()
        del self.engine


class TorchRunner:
    """The in-run baseline: the same model in plain PyTorch (fused AdamW, clipping 1.0; bf16
    autocast on CUDA), on ``device``."""

    def __init__(self, build_model, make_batch, device=None, lr: float = 1e-4, clip: float = 1.0,
                 label: str = "torch"):
        self.device = torch.device(device) if device is not None else default_device()
        self.make_batch, self.label, self.clip = make_batch, label, clip
        with torch.device(self.device):
            self.model = build_model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=True)

    def batches(self) -> list:
        out = [_call_batch(self.make_batch, self.device)]
        sync(self.device)
        return out

    autocast = True        # bf16 autocast on CUDA

    def step(self, batches) -> float:
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast and self.device.type == "cuda")
        with autocast:
            loss = loss_of(forward_batch(self.model, batches[0]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync(self.device)
        return float(loss.detach().float().item())

    def phases(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        del self.model, self.opt


class FSDP2Runner(TorchRunner):
    """The peer: the same model under PyTorch FSDP2 (``fully_shard`` on every child of
    ``blocks`` and on the root; bf16 parameters, fp32 reduction; fused AdamW over the fp32
    sharded parameters; clipping 1.0). ``reshard_after_forward=False`` is FSDP2's analogue of
    ZeRO-2 (parameters stay gathered between forward and backward). ``shard_group`` > 0 is
    HSDP: a 2-D device mesh (replicate x shard), sharded within groups of that many consecutive
    ranks and replicated across them. One process makes a one-rank process group of its own
    when none exists."""

    def __init__(self, build_model, make_batch, device=None, reshard_after_forward: bool = True,
                 lr: float = 1e-4, clip: float = 1.0, label: str = "fsdp2", shard_group: int = 0):
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        self.device = torch.device(device) if device is not None else default_device()
        if not dist.is_initialized():
            import tempfile
            store = dist.FileStore(tempfile.mktemp(prefix="zeroplug-fsdp2-"), 1)
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", store=store,
                                    rank=0, world_size=1)
        self.make_batch, self.label, self.clip = make_batch, label, clip
        with torch.device(self.device):
            self.model = build_model()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if self.device.type == "cuda" else None,
                                  reduce_dtype=torch.float32)
        world = dist.get_world_size()
        mesh = None
        if 0 < shard_group < world:
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh(self.device.type, (world // shard_group, shard_group),
                                    mesh_dim_names=("replicate", "shard"))
        for block in getattr(self.model, "blocks", []):
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        fully_shard(self.model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=self.device.type == "cuda")

    autocast = False       # the mixed-precision policy casts


def init_deepspeed():
    """``import deepspeed`` with its process group up; a single process gets the environment
    DeepSpeed's launcher would set (``RANK``, ``MASTER_ADDR``, ...)."""
    import os
    import socket

    import deepspeed
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed()
    return deepspeed


def deepspeed_engine(build_model, ds_config: dict, device=None):
    """``(engine, model)``: ``build_model()`` under DeepSpeed with ``ds_config`` (a DeepSpeed
    JSON as a dict). Stage 3 builds inside ``deepspeed.zero.Init`` (partitioned as it is
    built); below, on ``device`` when given (else where the model builds, and DeepSpeed
    moves it)."""
    from contextlib import nullcontext
    deepspeed = init_deepspeed()
    if ds_config.get("zero_optimization", {}).get("stage") == 3:
        where = deepspeed.zero.Init(config_dict_or_path=ds_config)
    else:
        where = torch.device(device) if device is not None else nullcontext()
    with where:
        model = build_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return engine, model


class DeepSpeedRunner(TorchRunner):
    """The other peer: the same model under DeepSpeed, from a DeepSpeed JSON config (a path).
    DeepSpeed is no dependency of zeroplug: install it to compare. One process sets the
    single-rank environment DeepSpeed's launcher would (``RANK``, ``MASTER_ADDR``, ...).

    ``torch_optimizer=True`` swaps the JSON's Adam/AdamW for torch's fused AdamW (DeepSpeed's
    ``torch_adam``), which holds the same states as DeepSpeed's FusedAdam without its
    just-in-time build (a minute of nvcc per machine)."""

    def __init__(self, build_model, make_batch, ds_json: str, device=None, torch_optimizer: bool = False,
                 label: str = "deepspeed"):
        import json
        self.device = torch.device(device) if device is not None else default_device()
        self.make_batch, self.label = make_batch, label
        with open(ds_json) as f:
            cfg = json.load(f)
        if torch_optimizer and cfg.get("optimizer", {}).get("type", "").lower() in ("adam", "adamw"):
            cfg["optimizer"]["params"] = {**cfg["optimizer"].get("params", {}), "torch_adam": True, "fused": True}
        self.engine, _ = deepspeed_engine(build_model, cfg, self.device)

    def step(self, batches) -> float:
        loss = loss_of(forward_batch(self.engine, batches[0]))
        self.engine.backward(loss)
        self.engine.step()
        sync(self.device)
        return float(loss.detach().float().item())

    def close(self) -> None:
        self.engine.destroy()
        del self.engine


def make_runner(build_model, make_batch, config, device=None, label=None):
    """An :class:`EngineRunner`, or a baseline: :class:`TorchRunner` for ``config="torch"``,
    :class:`FSDP2Runner` for ``"fsdp2"`` (``"fsdp2-no-reshard"``: parameters kept gathered
    between forward and backward; ``"fsdp2-hsdp:N"``: HSDP in groups of N), :class:`DeepSpeedRunner` for ``"deepspeed:PATH.json"``
    (``"deepspeed-torch-adam:PATH.json"``: with torch's fused AdamW)."""
    if isinstance(config, str) and config == "torch":
        return TorchRunner(build_model, make_batch, device, label=label or "torch")
    if isinstance(config, str) and config.startswith("fsdp2"):
        kind, _, group = config.partition(":")
        return FSDP2Runner(build_model, make_batch, device, reshard_after_forward=kind != "fsdp2-no-reshard",
                           label=label or config, shard_group=int(group or 0))
    if isinstance(config, str) and config.startswith("deepspeed"):
        kind, path = config.split(":", 1)
        return DeepSpeedRunner(build_model, make_batch, path, device, torch_optimizer=kind == "deepspeed-torch-adam",
                               label=label or "deepspeed")
    return EngineRunner(build_model, make_batch, config, device, label=label or "zeroplug")


def release(device: torch.device) -> None:
    """Give back what a finished runner held, before the next one is measured."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def start_peaks(device: torch.device) -> None:
    release(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    reset_peak_host()


def read_peaks(run: StepRun, device: torch.device) -> None:
    run.peak_gpu_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    run.peak_host_bytes = peak_host_bytes()


def run_steps(build_model, make_batch, config, steps: int = 5, warmup: int = 2, device=None,
              label: str | None = None, on_error: bool = False) -> StepRun:
    """Build, then ``warmup`` + ``steps`` steps; the median of the timed steps is the result.

    ``on_error``: return a :class:`StepRun` whose ``error`` says what failed (out of memory,
    a tier that lacks room) instead of raising; tune uses this to reject a candidate."""
    device = torch.device(device) if device is not None else default_device()
    run = StepRun(label or (config if isinstance(config, str) else "zeroplug"))
    start_peaks(device)
    runner = None
    try:
        runner = make_runner(build_model, make_batch, config, device, label)
        for i in range(warmup + steps):
            batches = runner.batches()
            t0 = time.perf_counter()
            loss = runner.step(batches)
            dt = time.perf_counter() - t0
            run.losses.append(loss)
            if i >= warmup:
                run.step_times.append(dt)
        run.tokens_per_step = sum(batch_tokens(b) for b in batches)
        run.phases = runner.phases()
        read_peaks(run, device)
    except Exception as exc:  # noqa: BLE001 - reported as the candidate's rejection
        if not on_error:
            raise
        run.error = describe_error(exc)
        read_peaks(run, device)
    finally:
        if runner is not None:
            try:
                runner.close()
            except Exception as exc:  # noqa: BLE001 - a failed build may leave a half-made engine
                log.debug("closing the runner after the measurement failed: %r", exc)
        del runner
        release(device)
    return run


def describe_error(exc: BaseException) -> str:
    """One line for a failed candidate."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "out of device memory: " + str(exc).splitlines()[0][:160]
    if isinstance(exc, MemoryError):
        return "out of host memory" + (f": {exc}" if str(exc) else "")
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:240]
