"""Optimizers over one rank's fp32 master shard (the ``[optimizer]`` slot).

adam / adamw / sgd run torch's fused kernels (CUDA and CPU) or, where a kernel is
missing, its multi-tensor foreach path; cpu_adam is our CPU Adam for offloaded
shards, with Adam's moments in fp32, bf16 or block-quantised int8 (state_dtype); "auto"
picks cpu_adam when the optimizer states live on the CPU while the model trains on a GPU
(or are CPU states held below fp32), else adamw. muon: Muon on the hidden matrices and
AdamW on the rest (muon.py); torch: torch's element-wise classes (torch_elementwise.py);
lion, lamb, ds_adagrad: DeepSpeed's update rules (deepspeed_rules.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from zeroplug import hookimpl
from zeroplug.errors import ConfigError
from zeroplug.options import opt
from zeroplug.quantized_states import state_bytes
from zeroplug.slots import OptimizerFactory

log = logging.getLogger("zeroplug")

IMPLEMENTATION_HELP = ("Kernel: \"fused\" (one kernel for all tensors), \"foreach\" (multi-tensor ops) "
                       "or \"auto\" (fused where torch has it for the device).")


def _kernel_flags(implementation: str, device: torch.device) -> dict:
    if implementation == "foreach":
        return {"foreach": True}
    if implementation == "fused" or device.type in ("cuda", "cpu"):
        return {"fused": True}
    return {"foreach": True}


@dataclass(frozen=True)
class AdamBaseOptions:
    lr: float = opt(1e-3, "Learning rate (the peak, when a schedule warms up to it).", min=0.0)
    betas: tuple[float, float] = opt((0.9, 0.999), "Adam's (beta1, beta2).", min=0.0, below=1.0)
    eps: float = opt(1e-8, "Added to the denominator for stability.", min=0.0)
    weight_decay: float = opt(0.0, "Weight decay (decoupled for adamw and adamw_mode, else L2).", min=0.0)


STATE_DTYPE_HELP = (
    "How Adam's two moments are held, per master element: \"fp32\" (8 bytes, exact), \"bf16\" (4 bytes: "
    "rounded to nearest bf16 at every step) or \"int8\" (2 bytes + 8 per 256: block-quantised 8-bit codes with "
    "one fp32 absmax per block of 256, bitsandbytes' 8-bit Adam format; signed dynamic code for the first "
    "moment, unsigned for the second). The master weights stay fp32; cpu_adam steps the small states in "
    "place, block by block. Needs cpu_adam (or auto) stepping offloaded states (offload.optimizer = cpu or "
    "nvme, or a CPU-only run); the cpu tier's GPU lane and GPU-resident sub-groups step fp32 states, so "
    "they are off with smaller ones. Checkpoints keep the states in this form; loading converts (docs/architecture.md, "
    "\"Smaller optimizer states\"). DeepSpeed: optimizer.params.fp32_optimizer_states = false and "
    "bf16.bf16_optimizer_states = true become \"bf16\".")



def _state_dtype_refused(path: str, value: str, why: str) -> ConfigError:
    return ConfigError(f"{path}.state_dtype = \"{value}\": {why}; set {path}.plugin = \"cpu_adam\" (or \"auto\") "
                       f"with offload.optimizer.plugin = \"cpu\" or \"nvme\", or state_dtype = \"fp32\"",
                       key=f"{path}.state_dtype")


@dataclass(frozen=True)
class AdamOptions(AdamBaseOptions):
    amsgrad: bool = opt(False, "Use the AMSGrad variant (GPU kernels only).")
    implementation: Literal["auto", "fused", "foreach"] = opt("auto", IMPLEMENTATION_HELP)
    state_dtype: Literal["fp32", "bf16", "int8"] = opt(
        "fp32", "adamw / adam keep fp32 states (torch's kernels); smaller states are cpu_adam's (its "
                "state_dtype).")

    def validate(self, path: str) -> None:
        if self.state_dtype != "fp32":
            raise _state_dtype_refused(path, self.state_dtype, "torch's Adam kernels step fp32 states only")


class AdamW(OptimizerFactory):
    """torch.optim.AdamW (decoupled weight decay) on fused or foreach kernels."""
    Options = AdamOptions
    torch_cls = torch.optim.AdamW

    def build(self, params, device):
        o = self.options
        return self.torch_cls(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                              amsgrad=o.amsgrad, **_kernel_flags(o.implementation, device))


class Adam(AdamW):
    """torch.optim.Adam (L2 weight decay added to the gradient)."""
    torch_cls = torch.optim.Adam


@dataclass(frozen=True)
class CPUAdamOptions(AdamBaseOptions):
    adamw_mode: bool = opt(True, "true: decoupled weight decay (AdamW); false: L2 (Adam).")
    bias_correction: bool = opt(True, "Apply Adam's bias correction.")
    amsgrad: bool = opt(False, "Not implemented by cpu_adam: setting it true is an error.")
    threads: int = opt(0, "CPU threads of this rank's optimizer step (torch's intra-op threads too): 0 = what "
                          "cpu_plan decides, whatever OMP_NUM_THREADS says; more than the rank's cores is "
                          "clamped, with a warning. ZEROPLUG_CPU_ADAM_THREADS sets it too (this option wins).",
                       min=0)
    cpu_plan: Literal["auto", "measure", "bind", "off"] = opt(
        "auto", "How the ranks of a host share its CPUs: \"measure\" splits this process's CPU affinity set "
                "(taskset, Slurm, a container's cpuset) into disjoint sets of whole cores, one per local rank "
                "(on the NUMA node of its GPU where there are several), binds each rank to its set (its data "
                "loader workers too), leaves cores for the offload tier's copy threads and the training loop, "
                "and runs the optimizer with the thread count that stepped fastest when all local ranks "
                "measured together (on the first run on a machine; cached in zeroplug's cache directory per "
                "machine, torch version and rank layout); \"bind\" splits and binds without measuring (every "
                "core of the set not left to others); \"off\" binds nothing and divides the cores among the "
                "local ranks; \"auto\" = measure when training on a GPU, off on a CPU-only run. Each rank "
                "prints its plan in one line.")
    while_building: Literal["auto", "eager", "wait"] = opt(
        "auto", "What steps do while the compiled kernel is still being built (the first run on a machine; "
                "later runs load it from the kernel cache during initialize): \"eager\" builds it in a "
                "background process (which finishes it even if the run ends first) and steps with the eager "
                "kernel (the same update, rounded differently in the last bits) until it is ready; \"wait\" "
                "makes initialize wait for it (bitwise reproducible); \"auto\" = eager when training on a "
                "GPU, wait on a CPU-only run (where the build and the steps share the cores).")
    state_dtype: Literal["fp32", "bf16", "int8"] = opt("fp32", STATE_DTYPE_HELP)

    def validate(self, path: str) -> None:
        if self.amsgrad:
            raise ConfigError(f"{path}.amsgrad = true: cpu_adam does not implement AMSGrad; use "
                              f"{path}.plugin = \"adamw\" (optimizer on the GPU) or set amsgrad = false",
                              key=f"{path}.amsgrad")


class CPUAdam(OptimizerFactory):
    """Our multi-threaded, single-pass Adam/AdamW for fp32 shards in CPU memory."""
    Options = CPUAdamOptions

    @classmethod
    def grad_dtypes(cls, options, run, state_device):
        return (torch.float32, torch.bfloat16, torch.float16)    # widened inside its one pass

    @classmethod
    def state_bytes(cls, options, run, state_device):
        return state_bytes(options.state_dtype)

    warm_up = None
    binding = None
    plan = None

    def plan_mode(self) -> str:
        mode = self.options.cpu_plan
        if mode == "auto":
            mode = "measure" if self.run.device.type != "cpu" else "off"
        return mode

    def begin(self, state_device):
        from .cpu_adam.native import LOADER as NATIVE
        from .cpu_adam.optimizer import native_steps
        from .cpu_adam.plan import start
        from .cpu_adam.warmup import WarmUp
        # Note: before the warm-up thread starts and before the tiers allocate host buffers
        # (cpu_adam.plan's module doc: first touch places pages on the binding's NUMA node)
        self.binding = start(self.run, self.plan_mode())
        mode = self.options.while_building
        if mode == "auto":
            mode = "wait" if self.run.device.type == "cpu" else "eager"
        native = native_steps(self.options.state_dtype)
        if native:
            NATIVE.start()      # built while the stage allocates, not in the first step
        self.warm_up = WarmUp(announce=self.run.rank == 0, eager_while_building=mode == "eager",
                              compiled=not native).start()

    def build(self, params, device):
        from .cpu_adam.optimizer import CPUAdam as Impl
        from .cpu_adam.plan import finish, say, tier_workers
        from .cpu_adam.topology import local_rank
        o = self.options
        if self.binding is None and self.warm_up is None and self.plan_mode() != "off":
            from .cpu_adam.plan import start     # built outside initialize
            self.binding = start(self.run, self.plan_mode())
        grads = [p.grad.dtype for g in params for p in (g["params"] if isinstance(g, dict) else [g])
                 if isinstance(p, torch.Tensor) and p.grad is not None]
        lp = self.run.config.slot("precision").impl.param_dtype if grads else None
        self.plan = finish(self.run, self.plan_mode(), self.binding, o.threads, tier_workers(self.run),
                           grads[0] if grads else torch.float32, lp)
        for warning in self.plan.warnings:
            if self.plan.own(warning) or local_rank() == 0:     # what every rank of the host shares: once
                log.warning("[zeroplug] %s", warning)
        say(self.plan.describe())
        threads = self.plan.threads
        optimizer = Impl(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                         adamw_mode=o.adamw_mode, bias_correction=o.bias_correction, threads=threads,
                         state_dtype=o.state_dtype)
        if self.warm_up is None:        # built outside initialize
            self.begin(device)
        self.warm_up.build(optimizer, *warm_up_variants(optimizer, self.run, threads))
        return optimizer

    def ready(self):
        if self.warm_up is not None:
            self.warm_up.finish()


def warm_up_variants(optimizer, run, threads: int) -> tuple[list, tuple]:
    """The kernel variants the steps will call, and their thread counts.

    Note: an offload tier allocates the masters' gradient buffers when it plans, so their
    dtype is the one its steps pass; it then writes the model-dtype copy in the same pass
    (lp = the precision's param_dtype, the slot's declared attribute). Masters without a
    gradient buffer are stepped by ``optimizer.step()``: fp32 gradients, no copy. Thread
    counts: the serial step's, and the overlapped step's (one core left to the loop)."""
    grads = [p.grad.dtype for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if grads:
        lp = run.config.slot("precision").impl.param_dtype
    else:
        grads, lp = [torch.float32], None
    counts = (threads, threads - 1) if threads > 1 else (threads,)
    return optimizer.kernel_variants(grads, lp), counts


class AutoOptimizer(OptimizerFactory):
    """cpu_adam for CPU states offloaded from a GPU (or held below fp32: state_dtype), else adamw."""
    Options = CPUAdamOptions
    cpu_adam: CPUAdam | None = None

    @staticmethod
    def _cpu_adam(run, state_device, options=None) -> bool:
        """Whether this choice is cpu_adam: states offloaded to the CPU from a GPU run, or CPU
        states held smaller than fp32 (only cpu_adam holds those)."""
        small = options is not None and options.state_dtype != "fp32"
        return state_device.type == "cpu" and (run.device.type != "cpu" or small)

    @classmethod
    def grad_dtypes(cls, options, run, state_device):
        if cls._cpu_adam(run, state_device, options):
            return CPUAdam.grad_dtypes(options, run, state_device)
        return (torch.float32,)

    @classmethod
    def state_bytes(cls, options, run, state_device):
        return state_bytes(options.state_dtype if cls._cpu_adam(run, state_device, options) else "fp32")

    def _check_states(self, state_device) -> None:
        if self.options.state_dtype != "fp32" and not self._cpu_adam(self.run, state_device, self.options):
            raise _state_dtype_refused("optimizer", self.options.state_dtype,
                                       "\"auto\" picks adamw here (the optimizer states stay on the GPU), "
                                       "whose kernels step fp32 states only")

    def begin(self, state_device):
        self._check_states(state_device)
        use = self._cpu_adam(self.run, state_device, self.options)
        self.cpu_adam = CPUAdam(self.options, self.run) if use else None
        if self.cpu_adam is not None:
            self.cpu_adam.begin(state_device)

    def build(self, params, device):
        o = self.options
        self._check_states(device)
        if self._cpu_adam(self.run, device, o):
            self.cpu_adam = self.cpu_adam or CPUAdam(o, self.run)
            return self.cpu_adam.build(params, device)
        return AdamW(AdamOptions(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay),
                     self.run).build(params, device)

    def ready(self):
        if self.cpu_adam is not None:
            self.cpu_adam.ready()


@dataclass(frozen=True)
class SGDOptions:
    lr: float = opt(1e-3, "Learning rate.", min=0.0)
    momentum: float = opt(0.0, "Momentum factor.", min=0.0)
    dampening: float = opt(0.0, "Dampening for momentum.", min=0.0)
    weight_decay: float = opt(0.0, "L2 weight decay.", min=0.0)
    nesterov: bool = opt(False, "Nesterov momentum (needs momentum > 0 and dampening = 0).")
    implementation: Literal["auto", "fused", "foreach"] = opt("auto", IMPLEMENTATION_HELP)

    def validate(self, path: str) -> None:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError(f"{path}.nesterov = true needs momentum > 0 and dampening = 0 "
                              f"(got momentum = {self.momentum}, dampening = {self.dampening})",
                              key=f"{path}.nesterov")


class SGD(OptimizerFactory):
    """torch.optim.SGD."""
    Options = SGDOptions

    @classmethod
    def state_bytes(cls, options, run, state_device):
        return 4.0 if options.momentum else 0.0      # the fp32 momentum buffer

    def build(self, params, device):
        o = self.options
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, dampening=o.dampening,
                               weight_decay=o.weight_decay, nesterov=o.nesterov,
                               **_kernel_flags(o.implementation, device))


@hookimpl
def zeroplug_register_optimizers(register):
    register("adamw", AdamW)
    register("adam", Adam)
    register("sgd", SGD)
    register("cpu_adam", CPUAdam)
    register("auto", AutoOptimizer)
    from .deepspeed_rules import AdagradFactory, LambFactory, LionFactory
    from .muon import Muon
    from .torch_elementwise import TorchElementwise
    register("muon", Muon)
    register("torch", TorchElementwise)
    register("lion", LionFactory)
    register("lamb", LambFactory)
    register("ds_adagrad", AdagradFactory)
