"""ZeroplugStrategy against plain Lightning (DDP) on a small LightningModule as users write it.

Run as a script under torchrun, this file is also the 2-device half of the tests:
``python -m torch.distributed.run --nproc-per-node 2 tests/integrations/test_integration_lightning.py OUT``
(the repository root on PYTHONPATH).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from zeroplug.errors import ConfigError  # noqa: E402
from zeroplug.integrations.lightning import ZeroplugStrategy  # noqa: E402

from tests.support.paths import child_env  # noqa: E402


def make_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                               torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))


class Regressor(L.LightningModule):
    """Weight decay on matrices only, a smaller lr for the rest, a warm-up schedule; the
    layers are built in configure_model (so stage 3 builds them sharded)."""

    def __init__(self, optimizer="adamw", schedule=True):
        super().__init__()
        self.net, self.optimizer_name, self.schedule, self.seen = None, optimizer, schedule, []

    def configure_model(self):
        if self.net is None:
            self.net = make_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.seen.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "adagrad":
            return torch.optim.Adagrad(self.parameters(), lr=0.01)
        matrices = [p for p in self.parameters() if p.dim() > 1]
        rest = [p for p in self.parameters() if p.dim() <= 1]
        opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                 {"params": rest, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2, betas=(0.9, 0.99))
        if not self.schedule:
            return opt
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class ManualRegressor(Regressor):
    """Manual optimization, layers built in __init__."""

    def __init__(self):
        super().__init__(schedule=False)
        self.automatic_optimization = False
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.seen.append(loss.item())
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()


def loader(n=32, batch=4):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True)


def fit(strategy, module=None, devices=1, max_steps=4, ckpt_path=None, callbacks=(), **kw):
    module = module or Regressor()
    kw = {"accumulate_grad_batches": 2, "gradient_clip_val": 1.0, **kw}
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
                        enable_checkpointing=bool(callbacks), callbacks=list(callbacks), enable_progress_bar=False,
                        enable_model_summary=False, **kw)
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return trainer, module


def rel(a, b) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


@contextlib.contextmanager
def lightning_leaves_no_trace():
    """Lightning's DDP on CPU leaves its process group, torch's thread count (set to the
    cores per process) and MASTER_ADDR / WORLD_SIZE / OMP_NUM_THREADS... behind; the tests
    that run after these must not inherit them."""
    threads, env = torch.get_num_threads(), dict(os.environ)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(env)


@pytest.fixture(autouse=True)
def each_test_leaves_no_trace():
    with lightning_leaves_no_trace():
        yield


@pytest.fixture(scope="module")
def plain():
    with lightning_leaves_no_trace():
        _, module = fit("ddp")
    return module.seen


@pytest.mark.parametrize("stage", ["stage0", "stage2"])
def test_follows_plain_lightning(plain, stage):
    trainer, module = fit(ZeroplugStrategy({"zero": {"plugin": stage}}))
    engine = trainer.strategy.engine
    assert engine.global_step == 4 and len(module.seen) == 8
    assert rel(plain, module.seen) < 1e-5
    # each group's lr follows the warm-up in proportion: 1e-2 and 5e-3 at full strength
    assert engine.get_lr() == pytest.approx([1e-2, 5e-3])


def test_manual_optimization():
    kw = {"accumulate_grad_batches": 1, "gradient_clip_val": None, "max_steps": 3}
    with lightning_leaves_no_trace():
        _, plain = fit("ddp", module=ManualRegressor(), **kw)
    trainer, module = fit(ZeroplugStrategy({"zero": {"plugin": "stage3"}}), module=ManualRegressor(), **kw)
    assert trainer.strategy.engine.global_step == 3
    assert rel(plain.seen, module.seen) < 1e-5


def test_precision_and_accumulation_come_from_the_trainer():
    trainer, _ = fit(ZeroplugStrategy(), precision="bf16-mixed", max_steps=1, accumulate_grad_batches=3)
    engine = trainer.strategy.engine
    assert engine.config.slot("precision").name == "bf16" and engine.gradient_accumulation_steps == 3
    assert engine.config.batch.gradient_clipping == 1.0
    assert next(engine.module.parameters()).dtype == torch.bfloat16


def test_a_config_schedule_drives_when_lightning_has_none():
    cfg = {"scheduler": {"plugin": "warmup", "warmup_num_steps": 4, "warmup_type": "linear"}}
    trainer, _ = fit(ZeroplugStrategy(cfg), module=Regressor(schedule=False), max_steps=2)
    # the second step ran at 1/4 of each group's lr
    assert trainer.strategy.engine.get_lr() == pytest.approx([1e-2 / 4, 5e-3 / 4])


@pytest.mark.parametrize("strategy_config, fit_kw, match", [
    (None, {"module": Regressor(optimizer="adagrad")}, "Adagrad"),
    ({"optimizer": {"lr": 0.5}}, {}, "optimizer.lr"),
    ({"precision": {"plugin": "fp16"}}, {"precision": "bf16-mixed"}, "precision.plugin"),
    ({"batch": {"gradient_accumulation_steps": 4}}, {}, "accumulate_grad_batches"),
    (None, {"gradient_clip_algorithm": "value"}, "gradient_clip_algorithm"),
    ({"scheduler": {"plugin": "warmup", "warmup_num_steps": 3}}, {}, "scheduler"),
])
def test_refuses_what_it_cannot_honour(strategy_config, fit_kw, match):
    with pytest.raises(ConfigError, match=match):
        fit(ZeroplugStrategy(strategy_config), max_steps=1, **fit_kw)


# --- two devices under torchrun ---------------------------------------------------------------

@pytest.mark.slow
def test_two_devices_stage3_under_torchrun(tmp_path):
    """Stage 3 on 2 devices (gloo): losses of plain Lightning DDP, checkpoints written by
    ModelCheckpoint every 2 steps, and a resumed fit that continues exactly."""
    env = child_env(ZEROPLUG_DEVICE="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--standalone", __file__, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert rel(r["plain"], r["zeroplug"]) < 1e-3
    assert r["checkpoints"] == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"]
    assert r["resumed"] == r["zeroplug"][8:]
    assert r["weight_diff"] == 0.0


STAGE3 = {"zero": {"plugin": "stage3", "stage3_param_persistence_threshold": 0}}


def _ranks_main(out: str) -> None:
    torch.set_num_threads(1)
    # 32 samples, 4 per batch, 2 devices: 4 micro-batches per device per epoch, 2 steps per epoch
    _, plain = fit("ddp", devices=2, max_steps=6)
    ckpt_dir = os.path.join(out, "ckpt")
    # Note: every 2 steps, not every epoch: Lightning itself (plain DDP too) does not resume an
    # end-of-epoch checkpoint exactly under gradient accumulation (it runs one batch more)
    every_2_steps = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_train_steps=2)
    first, run = fit(ZeroplugStrategy(STAGE3), devices=2, max_steps=6, callbacks=[every_2_steps])
    with first.strategy.engine.gathered_parameters():
        weights = {k: v.clone() for k, v in run.state_dict().items()}
    second, resumed = fit(ZeroplugStrategy(STAGE3), devices=2, max_steps=6,
                          ckpt_path=os.path.join(ckpt_dir, "epoch=1-step=4.ckpt"))
    with second.strategy.engine.gathered_parameters():
        again = {k: v.clone() for k, v in resumed.state_dict().items()}
    if dist.get_rank() == 0:
        result = {"plain": plain.seen, "zeroplug": run.seen, "resumed": resumed.seen,
                  "checkpoints": sorted(os.listdir(ckpt_dir)),
                  "weight_diff": max((weights[k] - again[k]).abs().max().item() for k in weights)}
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("ZEROPLUG_DEVICE", "cpu")
    _ranks_main(sys.argv[1])
    from tests.support.distributed import leave_without_teardown
    leave_without_teardown()
