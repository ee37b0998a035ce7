"""``deepspeed.initialize``, ``deepspeed.add_config_arguments`` and ``deepspeed.init_distributed``."""
from __future__ import annotations

import argparse
import logging

import torch

from zeroplug.errors import ConfigError

from .client import ClientSchedule, optimizer_groups, optimizer_table, read_config
from .comm import init_distributed
from .engine import DeepSpeedEngine

log = logging.getLogger("zeroplug")

__all__ = ["initialize", "add_config_arguments", "init_distributed", "ScheduleView", "EpochLoader"]


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: int = 29500, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """``(engine, optimizer, training_dataloader, lr_scheduler)`` as DeepSpeed returns them.

    ``config`` / ``config_params`` / ``args.deepspeed_config``: a DeepSpeed config (dict or
    JSON path; a zeroplug TOML path or dict works too). ``optimizer``: a torch optimizer (or a
    ``deepspeed.ops`` one) whose class, settings and parameter groups zeroplug's optimizer
    takes over, or a callable building one from ``model_parameters``. ``lr_scheduler``: a
    torch LR scheduler (or a callable building one from the engine's optimizer) that drives
    the engine's lr; a scheduler in the config takes precedence, as in DeepSpeed.
    ``training_data``: a dataset, returned as a DataLoader of micro batches (a
    DistributedSampler over the ranks)."""
    if model is None:
        raise ConfigError("deepspeed.initialize: model is required", key="model")
    if mpu is not None or mesh_param is not None:
        raise ConfigError("deepspeed.initialize(mpu=/mesh_param=): zeroplug trains data parallel over every "
                          "rank (no model or sequence parallelism); leave them out", key="mpu")
    if dist_init_required is not False:
        init_distributed(distributed_port=distributed_port)
    ds = read_config(config, config_params, args)
    overrides, groups, client_opt = [], model_parameters, None
    if optimizer is not None:
        client_opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(
            model_parameters if model_parameters is not None else
            [p for p in model.parameters() if p.requires_grad])
        if not isinstance(client_opt, torch.optim.Optimizer):
            raise ConfigError(f"deepspeed.initialize(optimizer=...): the callable returned "
                              f"{type(client_opt).__name__}, not a torch optimizer", key="optimizer")
        if isinstance(ds, dict) and "optimizer" in ds:
            log.warning("[zeroplug] deepspeed.initialize: an optimizer was passed and the config has one too; "
                        "the one passed is used (%s)", type(client_opt).__name__)
        overrides.append(("optimizer", optimizer_table(client_opt)))
        groups = optimizer_groups(client_opt)
        if _deepspeed_dict(ds) and "optimizer" not in ds:
            # Note: a stand-in section, replaced by the override: the translation would otherwise
            # say that zeroplug's default optimizer is used
            ds = {**ds, "optimizer": {"type": "AdamW", "params": {}}}
    config_schedules = _deepspeed_dict(ds) and "scheduler" in ds
    if lr_scheduler is not None and config_schedules:
        log.warning("[zeroplug] deepspeed.initialize: the config's scheduler drives the lr; the lr_scheduler "
                    "passed is not used (as in DeepSpeed)")
        lr_scheduler = None
    if lr_scheduler is not None or ds is None:
        # replaced by the script's below; no config: no schedule, as DeepSpeed has none by default
        overrides.append(("scheduler", {"plugin": "none"}))
    import zeroplug
    engine = zeroplug.initialize(model, ds, overrides, model_parameters=groups)
    returned = None
    config_schedules = engine.config.slot("scheduler").name != "none"
    if lr_scheduler is not None:
        returned = lr_scheduler if not callable(lr_scheduler) or hasattr(lr_scheduler, "step") \
            else lr_scheduler(engine.optimizer)
        bound = getattr(returned, "optimizer", None) or client_opt or engine.optimizer
        engine.use_schedule(ClientSchedule(returned, bound, engine.config.slot("optimizer").options.lr))
    elif not config_schedules:
        # Note: no schedule: the lr is what the optimizer's groups hold, so that a torch scheduler
        # the script builds on the returned optimizer and steps itself sets it (as with DeepSpeed)
        engine.use_schedule(ClientSchedule(None, engine.optimizer, engine.config.slot("optimizer").options.lr))
    ds_engine = DeepSpeedEngine(engine, returned)
    if returned is None and config_schedules:
        returned = ScheduleView(engine)
    loader = None
    if training_data is not None:
        drop_last = bool(ds.get("dataloader_drop_last", False)) if isinstance(ds, dict) else False
        loader = EpochLoader(training_data, engine.micro_batch_size, engine.run.world_size, engine.run.rank,
                             collate_fn, drop_last)
    return ds_engine, ds_engine.optimizer, loader, returned


def _deepspeed_dict(ds) -> bool:
    from zeroplug.convert import looks_like_deepspeed
    return isinstance(ds, dict) and looks_like_deepspeed(ds)


class ScheduleView:
    """The config's schedule as a scheduler object (the engine steps it: ``step()`` does
    nothing)."""

    def __init__(self, engine):
        self.engine = engine

    def get_last_lr(self) -> list[float]:
        return self.engine.get_lr()

    get_lr = get_last_lr

    @property
    def last_batch_iteration(self) -> int:
        return self.engine.lr_step - 1

    def step(self, *args, **kwargs) -> None:
        """The engine steps the schedule after every applied optimizer step."""

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        """The engine's checkpoint restores the schedule's step."""


class EpochLoader(torch.utils.data.DataLoader):
    """Micro batches of ``dataset`` for this rank (DistributedSampler, shuffled); each new
    pass over it is a new epoch of the sampler (a new order)."""

    def __init__(self, dataset, batch_size, world_size, rank, collate_fn=None, drop_last=False):
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                         drop_last=drop_last)
        self.epoch = 0

    def __iter__(self):
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return super().__iter__()


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line arguments: ``--deepspeed``, ``--deepspeed_config`` (and the
    old ``--deepscale`` / ``--deepscale_config``)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
