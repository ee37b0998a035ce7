"""``zeroplug.deepspeed``: DeepSpeed's API over zeroplug, one rank (the script-style tests
on 1 and 2 ranks are tests/integrations/test_deepspeed_scripts.py)."""
from __future__ import annotations

import argparse
import logging

import pytest
import torch

import zeroplug
import zeroplug.deepspeed as deepspeed
from zeroplug.deepspeed.accelerator import get_accelerator
from zeroplug.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zeroplug.errors import ConfigError
from tests.support.toy import ToyNet, batches


def config(**extra):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            **extra}


def test_initialize_returns_deepspeeds_four_values_and_an_nn_module():
    torch.manual_seed(0)
    model = ToyNet()
    data = torch.utils.data.TensorDataset(torch.randint(0, 37, (16, 8)), torch.randint(0, 37, (16, 8)))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed"])
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data,
        config=config(optimizer={"type": "AdamW", "params": {"lr": 1e-3}}, zero_optimization={"stage": 2}))
    assert isinstance(engine, torch.nn.Module) and engine.module is model
    assert optimizer is engine.optimizer and isinstance(optimizer, torch.optim.Optimizer)
    assert scheduler is None                         # no scheduler in the config, none passed
    assert len(loader) == 4 and next(iter(loader))[0].shape == (4, 8)
    holder = torch.nn.Module()
    holder.actor = engine                            # OpenRLHF keeps the engine as a child module
    assert {id(p) for p in holder.parameters()} == {id(p) for p in model.parameters()}
    assert engine.emb is model.emb                   # attributes fall through to the model
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        engine.nothing_here
    assert (engine.zero_optimization_stage(), engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == (2, 4, 4, 1)
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.local_rank == 0 and engine.device == torch.device("cpu")
    assert engine.get_global_grad_norm() is None and not engine.was_step_applied()
    for x, y in loader:
        loss = engine(x, y)
        engine.backward(loss)
        assert engine.is_gradient_accumulation_boundary()
        engine.step()
    assert engine.global_steps == 4 and engine.global_samples == 16
    assert engine.was_step_applied() and engine.get_global_grad_norm() > 0
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training


def test_config_from_args_and_both_refused(tmp_path):
    import json
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config(zero_optimization={"stage": 1})))
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed_config", str(path)])
    engine, *_ = deepspeed.initialize(args=args, model=ToyNet())
    assert engine.zero_optimization_stage() == 1
    with pytest.raises(ConfigError, match="pass one"):
        deepspeed.initialize(args=args, model=ToyNet(), config=config())


def plain_adamw_losses(groups_fn, steps, lr_fn, clip):
    torch.manual_seed(0)
    model = ToyNet()
    opt = torch.optim.AdamW(groups_fn(model), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_fn)
    out = []
    for x, y in batches(steps, 4):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def grouped(model):
    decay = [p for n, p in model.named_parameters() if "bias" not in n and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if "bias" in n or "norm" in n]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def warm(step):
    return min(1.0, (step + 1) / 3)


def test_client_optimizer_groups_and_scheduler_match_plain_torch():
    """A torch AdamW over grouped parameters and a LambdaLR built on it before initialize (as
    DeepSpeed-Chat does): the same losses as plain torch, with the clip applied on step one."""
    ref = plain_adamw_losses(grouped, 5, warm, clip=0.05)
    torch.manual_seed(0)
    model = ToyNet()
    opt = torch.optim.AdamW(grouped(model), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warm)
    engine, zopt, _, returned = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                                     config=config(gradient_clipping=0.05), dist_init_required=True)
    assert returned is sched and engine.lr_scheduler is sched
    assert [g["weight_decay"] for g in zopt.param_groups] == [0.1, 0.0]
    got = []
    for x, y in batches(5, 4):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert sched.last_epoch == 5


def test_optimizer_factory_and_scheduler_factory():
    ref = plain_adamw_losses(lambda m: m.parameters(), 3, warm, clip=1e9)
    torch.manual_seed(0)
    model = ToyNet()
    engine, _, _, sched = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warm))
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    got = []
    for x, y in batches(3, 4):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_deepspeed_ops_map_to_zeroplug_optimizers():
    from zeroplug.deepspeed.ops.lamb import FusedLamb
    cases = ((lambda ps: FusedAdam(ps, lr=1e-3), "adamw"), (lambda ps: FusedAdam(ps, adam_w_mode=False), "adam"),
             (lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3), "auto"),
             (lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=False), "cpu_adam"),
             (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "sgd"),
             (lambda ps: torch.optim.Adam(ps, lr=0.1), "adam"),
             (lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5), "torch"),
             (lambda ps: FusedLamb(ps, lr=1e-3, max_coeff=0.3), "lamb"))
    for build, plugin in cases:
        model = ToyNet()
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=build(model.parameters()), config=config())
        assert engine.zeroplug_engine.config.slot("optimizer").name == plugin
    with pytest.raises(Exception, match="is stepped by the engine"):
        FusedAdam(ToyNet().parameters()).step()


def test_refusals_are_one_line():
    model = ToyNet()
    with pytest.raises(ConfigError, match="closure") as e:
        deepspeed.initialize(model=model, optimizer=torch.optim.LBFGS(model.parameters()), config=config())
    assert "\n" not in str(e.value)

    class Mine(torch.optim.SGD):
        pass
    with pytest.raises(ConfigError, match="no zeroplug equivalent; use one of"):
        deepspeed.initialize(model=model, optimizer=Mine(model.parameters(), lr=0.1), config=config())
    with pytest.raises(ConfigError, match="maximize"):
        deepspeed.initialize(model=ToyNet(), config=config(),
                             optimizer=lambda ps: torch.optim.AdamW(ps, maximize=True))


def test_accelerator_and_comm_on_one_process():
    acc = get_accelerator()
    assert acc.device_name() == "cpu" and acc.current_device_name() == "cpu" and acc.device_count() == 1
    assert acc.communication_backend_name() == "gloo" and acc.is_bf16_supported()
    acc.synchronize()
    acc.empty_cache()
    acc.manual_seed(3)
    assert acc.memory_allocated() == 0 and acc.max_memory_allocated() == 0
    t = torch.ones(3)
    deepspeed.comm.all_reduce(t)
    deepspeed.comm.broadcast(t, 0)
    out = [torch.empty(3)]
    deepspeed.comm.all_gather(out, t)
    assert torch.equal(out[0], t) and torch.equal(t, torch.ones(3))
    assert (deepspeed.comm.get_rank(), deepspeed.comm.get_world_size(), deepspeed.comm.get_local_rank()) == (0, 1, 0)
    deepspeed.comm.barrier()
    deepspeed.init_distributed()                     # one process, no launcher: nothing to start


def test_load_checkpoint_missing_returns_none_with_a_warning(tmp_path, caplog):
    engine, *_ = deepspeed.initialize(model=ToyNet(), config=config())
    with caplog.at_level(logging.WARNING, logger="zeroplug"):
        assert engine.load_checkpoint(str(tmp_path / "none")) == (None, None)
    assert any("no checkpoint" in r.getMessage() for r in caplog.records)


def test_checkpoint_roundtrip_keeps_client_state_and_the_scripts_scheduler(tmp_path):
    def build():
        torch.manual_seed(0)
        model = ToyNet()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warm)
        return deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config())

    engine, _, _, sched = build()
    data = list(batches(6, 4))
    for x, y in data[:3]:
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(str(tmp_path), client_state={"epoch": 7})
    after = []
    for x, y in data[3:]:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        after.append(loss.item())
    engine2, _, _, sched2 = build()
    path, client = engine2.load_checkpoint(str(tmp_path), load_module_strict=True)
    assert client == {"epoch": 7} and sched2.last_epoch == 3 and path is not None
    again = []
    for x, y in data[3:]:
        loss = engine2(x, y)
        engine2.backward(loss)
        engine2.step()
        again.append(loss.item())
    assert again == after
    assert engine2.global_steps == 6


def _names(row_name: str) -> list[tuple[object, str]]:
    """(owner, attribute) for each name of a surface row: 'deepspeed.comm.a / b' -> comm.a, comm.b."""
    import importlib
    from zeroplug.deepspeed.accelerator import Accelerator
    from zeroplug.deepspeed.engine import DeepSpeedEngine
    parts = [p.strip().rstrip("()") for p in row_name.split(" / ")]
    first = parts[0]
    if first.startswith("DeepSpeedEngine."):
        return [(DeepSpeedEngine, p.split(".")[-1]) for p in parts]
    if first.startswith("get_accelerator()."):
        return [(Accelerator, p.split(".")[-1]) for p in parts]
    if first.startswith("deepspeed."):
        module_path, _, _ = ("zeroplug." + first).rpartition(".")
        module = importlib.import_module(module_path)
        return [(module, p.split(".")[-1]) for p in parts]
    return []


def test_api_page_is_generated_and_every_row_is_in_the_code():
    from pathlib import Path
    from zeroplug.deepspeed.surface import MODULES, SURFACE, api_markdown
    doc = Path(__file__).resolve().parents[2] / "docs" / "deepspeed-api.md"
    assert doc.read_text() == api_markdown() + "\n", "regenerate: zeroplug docs --deepspeed-api > docs/deepspeed-api.md"
    listed = set()
    for name, _, _, _ in SURFACE:
        for owner, attr in _names(name):
            if attr == "module":        # the child module, set per engine
                continue
            assert hasattr(owner, attr), f"{name}: {attr} is not in {owner}"
            listed.add((getattr(owner, "__name__", ""), attr))
    import importlib
    for module_path, names in MODULES.items():
        module = importlib.import_module(module_path)
        if isinstance(names, str):      # every public name of the module is on a row of its prefix
            rows = [r[0] for r in SURFACE if r[0].startswith(names)]
            on_page = {p.strip().split(".")[-1] for r in rows for p in r.split(" / ")}
            names = module.__all__
            missing = sorted(set(names) - on_page)
            assert not missing, f"{module_path}: not on the page: {missing}"
        for n in names:
            assert hasattr(module, n), f"{module_path}.{n}"
    public = [n for n in vars(deepspeed.DeepSpeedEngine) if not n.startswith("_")]
    rows = " ".join(r[0] for r in SURFACE if r[0].startswith("DeepSpeedEngine"))
    unlisted = [n for n in public if n not in rows and n not in ("consolidated_state_dict", "gathered_parameters",
                                                                 "close", "forward", "training")]
    assert not unlisted, f"DeepSpeedEngine members not on the page: {unlisted}"


def test_zero_init_takes_deepspeeds_arguments():
    """``deepspeed.zero.Init`` over zeroplug.init: stage 3 whatever the config says, its kwargs
    accepted, ``enabled=False`` a plain build, what zeroplug cannot do refused in one line."""
    from zeroplug.deepspeed.zero import Init
    ds = config(zero_optimization={"stage": 3})
    torch.manual_seed(0)
    plain = ToyNet()
    torch.manual_seed(0)
    with Init(config_dict_or_path=ds, remote_device="cpu", pin_memory=True, dtype=torch.float32):
        model = ToyNet()
    assert model.head.weight.data.numel() == 0 and tuple(model.head.weight.shape) == (37, 24)   # sharded
    with Init(enabled=False):
        whole = ToyNet()
    assert whole.head.weight.data.numel() == 37 * 24
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    sd = engine.consolidated_state_dict()
    assert all(torch.equal(sd[k], v) for k, v in plain.state_dict().items())    # the same values as a plain build
    with pytest.raises(ConfigError, match="dtype=torch.bfloat16.*the config trains fp32"):
        with Init(config_dict_or_path=ds, dtype=torch.bfloat16):
            ToyNet()
    with pytest.raises(ConfigError, match="module=...") as e:
        Init(module=ToyNet())
    assert "\n" not in str(e.value)


def test_returned_optimizer_zero_grad_and_a_scheduler_built_after_initialize():
    """Scripts call ``optimizer.zero_grad()`` on what initialize returned (torch's own would drop
    the fp32 masters' gradient views at stages 0-1 and crash the next step), and build a torch
    scheduler on it after initialize, stepping it themselves: the engine trains with that lr."""
    ref = plain_adamw_losses(lambda m: m.parameters(), 4, warm, clip=1e9)
    torch.manual_seed(0)
    model = ToyNet()
    engine, opt, _, none = deepspeed.initialize(
        model=model, model_parameters=model.parameters(),
        config=config(zero_optimization={"stage": 1},
                      optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}))
    assert none is None and isinstance(opt, torch.optim.Optimizer) and opt is engine.optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warm)
    got = []
    for x, y in batches(4, 4):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        sched.step()
        opt.zero_grad()
        got.append(loss.item())
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="stepped by the engine"):
        opt.step()


def test_parameters_belong_to_their_newest_engine_that_is_not_closed():
    from zeroplug.gathering import live_engines
    model = ToyNet()
    cfg = {"batch": {"micro_batch_size": 2}, "monitor": {"plugin": "none"}}
    first = zeroplug.initialize(model, cfg)
    second = zeroplug.initialize(model, cfg)           # wrapped again (a new fit, a new strategy)
    mine = [e for e in live_engines() if e.owns(model.head.weight)]
    assert mine[:2] == [second, first]
    second.close()
    assert second not in live_engines() and first in live_engines()
    first.close()
    assert first not in live_engines()


def test_z3_leaf_modules_under_deepspeeds_names():
    """`deepspeed.utils.set_z3_leaf_modules(model, [Cls])`, as MoE code calls it, marks zeroplug's leaves."""
    from zeroplug.deepspeed.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    model = torch.nn.Sequential(Experts(), torch.nn.Linear(4, 4))
    assert set_z3_leaf_modules(model, [Experts]) == [model[0]]
    assert z3_leaf_module(model[0]) and not z3_leaf_module(model[1]) and get_z3_leaf_modules(model) == [model[0]]
    unset_z3_leaf_modules(model, [Experts])
    assert get_z3_leaf_modules(model) == []
