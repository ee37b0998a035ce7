"""The conformance suite of offload tiers: what every tier, built-in or third-party, must do.

Subclass :class:`TierConformance` in a test module of your package and pytest runs every
check against your tier::

    from zeroplug.testing import TierConformance

    class TestMyTier(TierConformance):
        tier = "mytier"                 # the name your plugin registers

        def options(self, tmp_path):    # its table: [offload.optimizer] (and [offload.param])
            return {"level": 3}

The checks train a small model on the CPU for a few steps with the tier in
``[offload.optimizer]`` (and, if it holds parameters, ``[offload.param]`` at stage 3):

* exactness: fp32, AdamW, no clipping: losses and weights equal the run without
  offload bit for bit, at stages 1, 2 and 3; with clipping, within rounding;
* checkpoint round trip: save, load into a fresh engine, train on: bit for bit the
  same as training straight through; a checkpoint of the tier loads without offload
  (and the other way round) and continues the same;
* ``offload_states`` / ``reload_states`` round trip, training continuing exactly;
* cleanup: ``engine.close()`` leaves no files under the tier's paths and no threads.

Each check is also a plain function (``check_exact``, ...) for other test runners.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

import zeroplug
from zeroplug.registry import get_plugin_manager

STAGES = ("stage1", "stage2", "stage3")


class TinyNet(torch.nn.Module):
    """Embedding, an MLP block and a head: odd sizes (padding), several units and sub-groups."""

    def __init__(self, vocab: int = 29, d: int = 16, hidden: int = 40):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, x, y):
        h = self.emb(x)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        logits = self.head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def batches(n: int, seed: int = 0, vocab: int = 29):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (4, 8), generator=g), torch.randint(0, vocab, (4, 8), generator=g))
            for _ in range(n)]


def config(stage: str, tier: str | None, options: dict | None = None, params: bool = False,
           clip: float = 0.0) -> dict:
    """A small run's config with ``tier`` (None: nothing offloaded) holding the optimizer states
    (and, ``params``, the stage-3 parameter shards)."""
    cfg = {"zero": {"plugin": stage, "reduce_bucket_size": 300, "sub_group_size": 500,
                    **({"stage3_param_persistence_threshold": 0} if stage == "stage3" else {})},
           "precision": {"plugin": "fp32"},
           "optimizer": {"plugin": "adamw", "lr": 1e-2, "weight_decay": 0.01},
           "batch": {"micro_batch_size": 4, "gradient_clipping": clip},
           "monitor": {"plugin": "none"}}
    if tier is not None:
        cfg["offload"] = {"optimizer": {"plugin": tier, **(options or {})}}
        if params:
            cfg["offload"]["param"] = {"plugin": tier, **(options or {})}
    return cfg


def engine(cfg: dict, plugin_manager=None, seed: int = 0):
    torch.manual_seed(seed)
    return zeroplug.initialize(TinyNet(), cfg, device="cpu", plugin_manager=plugin_manager)


def train(eng, data) -> list[float]:
    out = []
    for x, y in data:
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        out.append(loss.item())
    eng.partitioner.wait_optimizer()
    return out


def weights(eng) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in eng.consolidated_state_dict().items()}


def _same(a: dict, b: dict, what: str, atol: float = 0.0) -> None:
    assert a.keys() == b.keys(), f"{what}: different keys"
    for k in a:
        ok = torch.equal(a[k], b[k]) if atol == 0 else torch.allclose(a[k], b[k], rtol=0, atol=atol)
        assert ok, f"{what}: {k} differs (max {(a[k].float() - b[k].float()).abs().max().item():.3g})"


def check_exact(tier: str, options: dict, stage: str, params: bool = False, plugin_manager=None,
                steps: int = 4) -> None:
    """Offload on equals offload off bit for bit (fp32, AdamW, no clipping)."""
    data = batches(steps)
    ref = engine(config(stage, None), plugin_manager)
    ref_losses, ref_w = train(ref, data), weights(ref)
    ref.close()
    eng = engine(config(stage, tier, options, params), plugin_manager)
    assert eng.offload_optimizer.capabilities.offloaded, f"{tier}: capabilities.offloaded is false"
    losses = train(eng, data)
    assert losses == ref_losses, f"{tier} at {stage}: losses {losses} != {ref_losses} without offload"
    _same(weights(eng), ref_w, f"{tier} at {stage}")
    eng.close()


def check_clipped(tier: str, options: dict, plugin_manager=None, steps: int = 4) -> None:
    """With gradient clipping (the norm is computed another way): the same within rounding."""
    data = batches(steps, seed=1)
    ref = engine(config("stage2", None, clip=0.05), plugin_manager)
    ref_losses, ref_w = train(ref, data), weights(ref)
    eng = engine(config("stage2", tier, options, clip=0.05), plugin_manager)
    losses = train(eng, data)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    _same(weights(eng), ref_w, f"{tier} with clipping", atol=1e-5)
    ref.close()
    eng.close()


def check_checkpoint(tier: str, options: dict, tmp_path, params: bool = False, plugin_manager=None) -> None:
    """Save, load into a fresh engine, train on: the same bits as training straight through;
    the checkpoint also loads without offload, and one saved without offload loads into the tier."""
    data = batches(6, seed=2)
    stage = "stage3"
    cfg = config(stage, tier, options, params)
    straight = engine(cfg, plugin_manager)
    ref_losses = train(straight, data)
    ref_w = weights(straight)
    straight.close()

    first = engine(cfg, plugin_manager)
    train(first, data[:3])
    first.save_checkpoint(tmp_path / "tier")
    first.close()
    for load_cfg in (cfg, config(stage, None)):         # into the tier, and without offload
        eng = engine(load_cfg, plugin_manager, seed=7)
        eng.load_checkpoint(tmp_path / "tier")
        losses = train(eng, data[3:])
        assert losses == ref_losses[3:], f"{tier}: after loading, losses {losses} != {ref_losses[3:]}"
        _same(weights(eng), ref_w, f"{tier}: resumed")
        eng.close()

    plain = engine(config(stage, None), plugin_manager)
    train(plain, data[:3])
    plain.save_checkpoint(tmp_path / "plain")
    plain.close()
    eng = engine(cfg, plugin_manager, seed=7)
    eng.load_checkpoint(tmp_path / "plain")
    assert train(eng, data[3:]) == ref_losses[3:], f"{tier}: a checkpoint saved without offload"
    eng.close()


def check_offload_states(tier: str, options: dict, tmp_path, plugin_manager=None) -> None:
    """``offload_states`` moves what the engine holds, ``reload_states`` brings it back exactly."""
    data = batches(4, seed=3)
    cfg = config("stage3", tier, options)
    ref = engine(cfg, plugin_manager)
    ref_losses = train(ref, data)
    ref.close()
    eng = engine(cfg, plugin_manager)
    losses = train(eng, data[:2])
    eng.offload_states(device="nvme", nvme_path=str(tmp_path))
    try:
        eng(*data[0])
        raise AssertionError("a forward with states offloaded must be refused")
    except zeroplug.StateError:
        pass
    eng.reload_states()
    losses += train(eng, data[2:])
    assert losses == ref_losses, f"{tier}: losses after offload_states / reload_states differ"
    eng.close()
    assert not list(Path(tmp_path).iterdir()), f"{tier}: offload_states left files behind"


def check_cleanup(tier: str, options: dict, paths, plugin_manager=None) -> None:
    """After ``engine.close()`` no file is left under ``paths`` and no thread the engine
    started is alive; closing the tier again is harmless."""
    before = set(threading.enumerate())
    eng = engine(config("stage3", tier, options), plugin_manager)
    train(eng, batches(2))
    eng.close()
    eng.offload_optimizer.close()
    deadline = time.monotonic() + 5
    while True:
        alive = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not alive, f"{tier}: threads alive after engine.close(): {[t.name for t in alive]}"
    for p in paths:
        left = [os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs]
        assert not left, f"{tier}: files left after engine.close(): {left[:5]}"


class TierConformance:
    """Subclass with ``tier`` (the registered name) and, if needed, ``options(tmp_path)``
    and ``plugin_manager()``; pytest runs each check (``test_*``)."""
    tier: str = ""

    def options(self, tmp_path) -> dict:
        """The tier's table (``tmp_path``: a fresh directory for files it writes)."""
        return {}

    def paths(self, tmp_path) -> list:
        """Directories the tier writes into (checked empty after close)."""
        return [p for p in self.options(tmp_path).values() if isinstance(p, str) and p.startswith(str(tmp_path))]

    def plugin_manager(self):
        """None: the plugins installed (entry points); or a PluginManager with the tier registered."""
        return None

    def _holds_params(self) -> bool:
        pm = self.plugin_manager() or get_plugin_manager()
        return "param" in pm.get("offload", self.tier, key="offload.optimizer.plugin").impl.kinds

    def test_exact_stage1(self, tmp_path):
        check_exact(self.tier, self.options(tmp_path), "stage1", plugin_manager=self.plugin_manager())

    def test_exact_stage2(self, tmp_path):
        check_exact(self.tier, self.options(tmp_path), "stage2", plugin_manager=self.plugin_manager())

    def test_exact_stage3(self, tmp_path):
        check_exact(self.tier, self.options(tmp_path), "stage3", params=self._holds_params(),
                    plugin_manager=self.plugin_manager())

    def test_clipped(self, tmp_path):
        check_clipped(self.tier, self.options(tmp_path), plugin_manager=self.plugin_manager())

    def test_checkpoint_round_trip(self, tmp_path):
        check_checkpoint(self.tier, self.options(tmp_path), tmp_path, params=self._holds_params(),
                         plugin_manager=self.plugin_manager())

    def test_offload_states(self, tmp_path):
        (tmp_path / "states").mkdir()
        check_offload_states(self.tier, self.options(tmp_path), tmp_path / "states",
                             plugin_manager=self.plugin_manager())

    def test_cleanup(self, tmp_path):
        check_cleanup(self.tier, self.options(tmp_path), self.paths(tmp_path), plugin_manager=self.plugin_manager())


__all__ = ["TierConformance", "TinyNet", "check_exact", "check_clipped", "check_checkpoint",
           "check_offload_states", "check_cleanup", "config", "batches", "train"]
