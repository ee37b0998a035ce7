"""Stage 3 with a forward that changes from step to step, and with shared modules.

The model takes branch A on even training steps, branch B on odd ones and a third
branch only in eval; one Linear runs twice per forward; the head's weight is the
embedding's. Prefetch follows the previous step's order, so every step after the
first prefetches units that the changed path then does not use. Checked on 2 real
ranks: losses (train and eval) equal plain torch AdamW, nothing raises ("still in
flight" or otherwise), every non-persistent unit is freed after each step and after
an eval forward under no_grad, and prefetch really starts gathers ahead of use.

Note: a flat-buffer optimizer steps every parameter every step; a parameter that got
no gradient (the branch not taken, the eval-only branch) is stepped with a zero
gradient (Adam's moments decay, weight decay applies), as in DeepSpeed. torch's AdamW
skips parameters whose ``.grad`` is None, so the reference keeps zero-filled gradients
(``zero_grad(set_to_none=False)``) to run the same mathematics.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.distributed import run_ranks
from tests.support.toy import batches

WORLD = 2
STEPS = 8
GLOBAL_BATCH = 8
EVAL_EVERY = 3              # an eval forward (no_grad) after steps 0, 3, 6
LR, WD = 1e-2, 0.01
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5      # fp32: rounding-order differences only


class Branchy(torch.nn.Module):
    def __init__(self, vocab=37, d=24):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.shared = torch.nn.Linear(d, d)                       # runs twice per forward
        self.branch_a = torch.nn.Sequential(torch.nn.Linear(d, 40), torch.nn.GELU(), torch.nn.Linear(40, d))
        self.branch_b = torch.nn.Linear(d, d)
        self.eval_only = torch.nn.Linear(d, d)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight                       # tied embedding / head
        self.calls = 0                                           # training forwards so far

    def forward(self, x, y):
        h = self.emb(x)
        h = h + torch.tanh(self.shared(h))
        if self.training:
            branch = self.branch_a if self.calls % 2 == 0 else self.branch_b
            self.calls += 1
        else:
            branch = self.eval_only
        h = h + branch(h)
        h = h + torch.tanh(self.shared(h))
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


def data():
    fixed = list(batches(2, GLOBAL_BATCH))
    return [fixed[i % 2] for i in range(STEPS)]


def reference():
    torch.manual_seed(0)
    model = Branchy()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, evals = [], []
    for i, (x, y) in enumerate(data()):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
        if i % EVAL_EVERY == 0:
            model.eval()
            with torch.no_grad():
                evals.append(model(x, y).item())
            model.train()
    return losses, evals, {k: v.detach().clone() for k, v in model.state_dict().items()}


SCENARIOS = {
    # everything sharded, prefetch on (budget larger than the model)
    "plain": dict(use_init=False, zero={"stage3_param_persistence_threshold": 0,
                                        "stage3_prefetch_bucket_size": 1_000_000}),
    "init": dict(use_init=True, zero={"stage3_param_persistence_threshold": 0,
                                      "stage3_prefetch_bucket_size": 1_000_000}),
    # defaults: small modules (LayerNorm) persistent; reuse distance 0 frees the shared
    # Linear between its two uses; a prefetch budget that fits only some units
    "persistent": dict(use_init=True, zero={"stage3_prefetch_bucket_size": 1300,
                                            "stage3_max_reuse_distance": 0}),
}


def _config(zero):
    return {"zero": {"plugin": "stage3", **zero}, "precision": {"plugin": "fp32"},
            "optimizer": {"plugin": "adamw", "lr": LR, "weight_decay": WD},
            "batch": {"micro_batch_size": GLOBAL_BATCH // WORLD, "steps_per_print": 10_000},
            "monitor": {"plugin": "none"}}


def run_scenario(rank, world, use_init, zero):
    import zeroplug
    cfg = _config(zero)
    torch.manual_seed(0)
    if use_init:
        with zeroplug.init(cfg):
            model = Branchy()
    else:
        model = Branchy()
    engine = zeroplug.initialize(model, cfg)
    part = engine.partitioner
    assert model.head.weight is model.emb.weight
    sharded = [u for u in part.units if not u.persistent]

    def held():     # non-persistent units that still hold their gathered copy
        return [(u.index, u.state) for u in sharded
                if u.state != "free" or u.full.untyped_storage().size() != 0]

    # units in flight right after the first module's fetch (engine's hooks run first)
    seen = {"inflight": -1}
    model.emb.register_forward_pre_hook(
        lambda m, a: seen.update(inflight=sum(u.state == "inflight" for u in part.units)))
    inflight_seen = []          # per training step
    per = GLOBAL_BATCH // world
    losses, evals, held_after_step, held_after_eval = [], [], [], []
    fwd_prefetches, bwd_prefetches = [], []     # gathers started ahead of use, per step
    for i, (x, y) in enumerate(data()):
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        before = part.prefetch_count
        loss = engine(xs, ys)
        fwd_prefetches.append(part.prefetch_count - before)
        inflight_seen.append(seen["inflight"])
        engine.backward(loss)
        engine.step()
        held_after_step.append(held())
        bwd_prefetches.append(part.prefetch_count - before - fwd_prefetches[-1])
        t = loss.detach().clone()
        engine.run.comm.all_reduce(t)
        losses.append(t.item() / world)
        if i % EVAL_EVERY == 0:
            engine.eval()
            with torch.no_grad():
                e = engine(xs, ys)
            held_after_eval.append(held())
            engine.train()
            engine.run.comm.all_reduce(e)
            evals.append(e.item() / world)
    sd = engine.consolidated_state_dict()
    return {"losses": losses, "evals": evals, "state": sd, "held_after_step": held_after_step,
            "held_after_eval": held_after_eval, "fwd_prefetches": fwd_prefetches,
            "bwd_prefetches": bwd_prefetches, "inflight": inflight_seen,
            "n_sharded": len(sharded), "n_units": len(part.units),
            "persistent": [type(m).__name__ for m, us in part.units_of_module.items()
                           if any(u.persistent for u in us)]}


def run_all(rank, world):
    return {name: run_scenario(rank, world, **kw) for name, kw in SCENARIOS.items()}


@pytest.fixture(scope="module")
def results():
    return run_ranks(run_all, WORLD)


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_losses_match_torch_adamw(scenario, results, ref):
    ref_losses, ref_evals, ref_state = ref
    for rank, res in enumerate(results):
        r = res[scenario]
        for name, got, want in (("train", r["losses"], ref_losses), ("eval", r["evals"], ref_evals)):
            assert len(got) == len(want)
            worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
            assert worst <= LOSS_RTOL, f"rank {rank} {scenario} {name}: {worst:.3g}\n{got}\n{want}"
    state = results[0][scenario]["state"]
    assert results[1][scenario]["state"] is None
    assert set(state) == set(ref_state)         # head.weight appears (tied) as in torch
    for k, v in ref_state.items():
        diff = (state[k] - v).abs().max().item()
        assert diff <= PARAM_ATOL, f"{scenario}: {k} differs by {diff:.3g}"
    assert torch.equal(state["head.weight"], state["emb.weight"])


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_unit_freed_after_step_and_eval(scenario, results):
    for rank, res in enumerate(results):
        r = res[scenario]
        assert r["n_sharded"] >= 6, "the scenario must shard the modules it exercises"
        for i, held in enumerate(r["held_after_step"]):
            assert held == [], f"rank {rank} {scenario}: after step {i} units still held: {held}"
        for i, held in enumerate(r["held_after_eval"]):
            assert held == [], f"rank {rank} {scenario}: after eval {i} units still held: {held}"


def test_persistence_threshold_keeps_small_modules_whole(results):
    r = results[0]["persistent"]
    assert r["persistent"] == ["LayerNorm"]        # 48 elements <= 10 x hidden (240)
    assert results[0]["plain"]["persistent"] == []


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_prefetch_gathers_ahead_of_use(scenario, results):
    for rank, res in enumerate(results):
        r = res[scenario]
        # forward of step 0: no recorded order yet, nothing can be prefetched
        assert r["fwd_prefetches"][0] == 0 and r["inflight"][0] == 0
        # from step 1 on the forward follows the previous order: gathers start ahead of
        # use and are still in flight when the first module runs
        assert r["fwd_prefetches"][1] > 0, f"rank {rank} {scenario}: no forward prefetch in step 1"
        assert r["inflight"][1] > 0
        assert all(n > 0 for n in r["fwd_prefetches"][1:])
        # backward follows this step's forward order reversed, from step 0 on
        assert all(n > 0 for n in r["bwd_prefetches"])
