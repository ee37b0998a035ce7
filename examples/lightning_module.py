"""Train a LightningModule with ``ZeroplugStrategy`` (ZeRO stage 3).

    python examples/lightning_module.py                           # one device
    python examples/lightning_module.py --devices 2               # Lightning starts 2 processes
    torchrun --nproc-per-node 2 examples/lightning_module.py --devices 2
    python examples/lightning_module.py --config zero.toml        # any zeroplug TOML or DeepSpeed JSON

A small byte-level GPT learns the bytes of the Python standard library's sources. The
LightningModule is written as for any strategy: ``training_step`` returns the loss,
``configure_optimizers`` an AdamW with two parameter groups and a warm-up schedule,
``configure_model`` builds the layers (under stage 3: already sharded). Checkpoints come
from Lightning's ``ModelCheckpoint``; ``--resume PATH`` continues from one.
"""
from __future__ import annotations

import argparse

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from zeroplug.plugins.workload.data import stdlib_corpus
from zeroplug.integrations.lightning import ZeroplugStrategy
from zeroplug.plugins.workload.models import GPT, get_preset

STAGE3 = {"zero": {"plugin": "stage3"}}


class ByteGPT(L.LightningModule):
    def __init__(self, lr: float = 3e-3):
        super().__init__()
        self.lr, self.model = lr, None

    def configure_model(self):
        if self.model is None:
            self.model = GPT(get_preset("char-tiny", seq_len=64, n_layer=2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.model(x, y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.model(x, y), sync_dist=True)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() > 1 and "emb" not in n]
        rest = [p for n, p in self.named_parameters() if not (p.dim() > 1 and "emb" not in n)]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=self.lr, betas=(0.9, 0.95))
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def byte_windows(data: bytes, seq: int) -> torch.utils.data.TensorDataset:
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    windows = tokens[: (len(tokens) - 1) // seq * seq + 1]
    x = windows[:-1].view(-1, seq)
    y = windows[1:].view(-1, seq)
    return torch.utils.data.TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--out", default="runs/lightning")
    p.add_argument("--config", default=None, help="a zeroplug TOML or DeepSpeed JSON (default: stage 3)")
    p.add_argument("--resume", default=None, help="a checkpoint written by this script")
    a = p.parse_args()

    corpus = stdlib_corpus(max_bytes=600_000)
    split = len(corpus) * 9 // 10
    train = torch.utils.data.DataLoader(byte_windows(corpus[:split], 64), batch_size=8, shuffle=True)
    held_out = torch.utils.data.DataLoader(
        torch.utils.data.Subset(byte_windows(corpus[split:], 64), range(64)), batch_size=16)

    torch.manual_seed(0)
    trainer = L.Trainer(
        strategy=ZeroplugStrategy(a.config or STAGE3), accelerator="auto", devices=a.devices,
        max_steps=a.steps, accumulate_grad_batches=2, gradient_clip_val=1.0, val_check_interval=20,
        limit_val_batches=4, log_every_n_steps=5, logger=False, enable_progress_bar=False,
        callbacks=[ModelCheckpoint(dirpath=f"{a.out}/checkpoints", every_n_train_steps=20, save_top_k=-1)])
    module = ByteGPT()
    trainer.fit(module, train, held_out, ckpt_path=a.resume)
    if trainer.is_global_zero:
        metrics = ", ".join(f"{k} {v:.3f}" for k, v in sorted(trainer.callback_metrics.items()))
        print(f"step {trainer.global_step}: {metrics}; checkpoints in {a.out}/checkpoints")


if __name__ == "__main__":
    main()
