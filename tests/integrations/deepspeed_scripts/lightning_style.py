"""A Lightning script written for ``Trainer(strategy="deepspeed_stage_3")``.

Ported by one word (``"zeroplug_stage_3"``) and the import that registers the name. The
Trainer launches its own processes (``--devices 2``). Rank 0 writes the per-step losses
(averaged over the ranks) to ``<output_dir>/losses.json``.
"""
import argparse
import json
import os

import lightning as L
import torch
import torch.nn.functional as F

import zeroplug.integrations.lightning  # noqa: F401  (registers the zeroplug_* strategy names)


class LitLM(L.LightningModule):
    def __init__(self, vocab=61, d=32, lr=1e-2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.GELU(), torch.nn.Linear(64, d))
        self.head = torch.nn.Linear(d, vocab)
        self.lr = lr
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.emb(x)
        h = h + self.mlp(h)
        loss = F.cross_entropy(self.head(h).view(-1, self.head.out_features), y.view(-1))
        self.losses.append(loss.detach())
        return loss

    def on_train_end(self):
        gathered = self.all_gather(torch.stack(self.losses))
        self.step_losses = (gathered.mean(0) if gathered.dim() > 1 else gathered).tolist()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--max_steps", type=int, default=4)
    args = p.parse_args()
    L.seed_everything(42)
    model = LitLM()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 61, (64, 8), generator=g)
    y = torch.randint(0, 61, (64, 8), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size)
    trainer = L.Trainer(strategy="zeroplug_stage_3",   # was: strategy="deepspeed_stage_3"
                        accelerator="cpu", devices=args.devices, max_steps=args.max_steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, loader)
    if trainer.is_global_zero:
        with open(os.path.join(args.output_dir, "losses.json"), "w") as f:
            json.dump(model.step_losses, f)


if __name__ == "__main__":
    main()
