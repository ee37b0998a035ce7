"""Ranks whose forward runs different modules never hang stage 3 (2 real ranks, gloo).

Stage 3 gathers a module's parameters with a collective right before the module runs, so
two ranks that run different modules would wait for each other forever. Three layouts:

* experts on the model itself: an ``experts`` ModuleList held by the model, whose own forward
  routes rank 0's tokens to experts 0-1 and rank 1's to experts 2-3. Stage 3 gathers the list
  with the model's own forward, on every rank, and trains as torch's AdamW does on the
  concatenated batch, with and without the optimizer offloaded to the CPU; with the rule off
  (``stage3_auto_leaf_modules = false``) every rank stops with one error that names the
  experts and says how to declare them, and the declaration it gives trains;
* a branch that skips a module on rank 1: every rank stops with one error naming the module;
  declared as the error says, it trains;
* a forward that runs two modules in a different order per rank: the same.

Each run is bounded in time (a hang fails the test).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zeroplug
from zeroplug.errors import RanksDisagree
from tests.support import toy
from tests.support.distributed import run_ranks

WORLD, STEPS = 2, 3
VOCAB, D, EXPERTS = 32, 16, 4
LR, WD = 1e-2, 0.01
TIMEOUT = 300


def experts_model():
    return toy.ExpertsOnTheModel(VOCAB, D, hidden=24, experts=EXPERTS, head_bias=True)


class Branchy(torch.nn.Module):
    """``skip``: rank 1 does not run ``extra``; ``swap``: rank 1 runs ``a`` and ``b`` the other way
    round; ``skip-later``: rank 1 does not run ``extra`` in its third forward only (when stage 3
    has gathered it ahead, as the forwards before went)."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.calls = 0
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.a = torch.nn.Linear(D, D)
        self.b = torch.nn.Linear(D, D)
        self.extra = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, VOCAB)

    def forward(self, x, y):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.calls += 1
        h = self.emb(x)
        first, second = (self.b, self.a) if self.mode == "swap" and rank == 1 else (self.a, self.b)
        h = h + torch.tanh(second(torch.tanh(first(h))))
        skip = self.mode == "skip" or self.mode == "skip-later" and self.calls == 3
        if not (skip and rank == 1):
            h = h + torch.tanh(self.extra(h))
        return F.cross_entropy(self.head(h).view(-1, VOCAB), y.view(-1))


def data(rank: int, accumulation: int = 1):
    """Per step, its micro-batches: rank r's tokens lie in [r * VOCAB/2, (r+1) * VOCAB/2), so
    its experts are 2r and 2r+1 (rank -1: every rank's, by rank)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        micro = []
        for _ in range(accumulation):
            per = []
            for r in range(WORLD):
                x = torch.randint(0, VOCAB // WORLD, (2, 6), generator=g) + r * VOCAB // WORLD
                per.append((x, torch.randint(0, VOCAB, (2, 6), generator=g)))
            micro.append(per[rank] if rank >= 0 else per)
        out.append(micro)
    return out


def config(stage=3, offload=False, accumulation=1, **zero):
    cfg = {"zero": {"plugin": f"stage{stage}", **zero}, "precision": {"plugin": "fp32"},
           "optimizer": {"plugin": "adamw", "lr": LR, "weight_decay": WD},
           "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": accumulation,
                     "gradient_clipping": 0.0, "steps_per_print": 10_000},
           "monitor": {"plugin": "none"}}
    if stage == 3:
        cfg["zero"].setdefault("stage3_param_persistence_threshold", 0)
    if offload:
        cfg["offload"] = {"optimizer": {"plugin": "cpu"}}
    return cfg


def train(rank, model, cfg, declare=None):
    if declare is not None:
        zeroplug.set_leaf_modules(model, declare(model))
    engine = zeroplug.initialize(model, cfg)
    losses = []
    try:
        for micro in data(rank, engine.gradient_accumulation_steps):
            t = torch.zeros(())
            for x, y in micro:
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                t += loss.detach() / len(micro)
            engine.run.comm.all_reduce(t)
            losses.append(t.item() / WORLD)
    except RanksDisagree as exc:
        return {"error": str(exc)}
    return {"losses": losses, "state": engine.consolidated_state_dict()}


TRAINS = {
    "experts-stage3": lambda: (experts_model(), config(), None),
    "experts-stage3-offload": lambda: (experts_model(), config(offload=True), None),
    "experts-stage2": lambda: (experts_model(), config(2), None),
    "experts-stage2-offload": lambda: (experts_model(), config(2, offload=True), None),
    # 2 micro-steps: each rank's backward reaches its own experts only, in each micro-step
    "experts-stage2-accumulation": lambda: (experts_model(), config(2, accumulation=2), None),
    "experts-stage3-accumulation": lambda: (experts_model(), config(accumulation=2), None),
    "experts-declared": lambda: (experts_model(), config(stage3_auto_leaf_modules=False),
                                 lambda m: [m.experts]),
    "skip-declared": lambda: (Branchy("skip"), config(), lambda m: [m.extra]),
    "swap-declared": lambda: (Branchy("swap"), config(), lambda m: [m.a, m.b]),
}
STOPS = {
    "experts-rule-off": lambda: (experts_model(), config(stage3_auto_leaf_modules=False), None),
    "skip": lambda: (Branchy("skip"), config(), None),
    "swap": lambda: (Branchy("swap"), config(), None),
    "skip-later": lambda: (Branchy("skip-later"), config(stage3_prefetch_bucket_size=10**6), None),
}


def run_all(rank, world):
    out = {}
    for name, make in {**TRAINS, **STOPS}.items():
        torch.manual_seed(0)
        model, cfg, declare = make()
        out[name] = train(rank, model, cfg, declare)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(run_all, WORLD, timeout=TIMEOUT)


def reference(model, accumulation: int = 1):
    """torch AdamW on both ranks' batches at once (DDP semantics)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for micro in data(-1, accumulation):
        total = 0.0
        for per in micro:
            x = torch.cat([x for x, _ in per])
            y = torch.cat([y for _, y in per])
            if isinstance(model, Branchy):      # each rank's half through its own path
                loss = sum(_branchy_loss(model, r, xr, yr) for r, (xr, yr) in enumerate(per)) / WORLD
            else:
                loss = model(x, y)
            (loss / accumulation).backward()
            total += loss.item() / accumulation
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model.state_dict()


def _branchy_loss(model, rank, x, y):
    h = model.emb(x)
    first, second = (model.b, model.a) if model.mode == "swap" and rank == 1 else (model.a, model.b)
    h = h + torch.tanh(second(torch.tanh(first(h))))
    if not (model.mode == "skip" and rank == 1):
        h = h + torch.tanh(model.extra(h))
    return F.cross_entropy(model.head(h).view(-1, VOCAB), y.view(-1))


@pytest.mark.parametrize("case", list(TRAINS))
def test_trains_as_torch_does(case, results):
    torch.manual_seed(0)
    model, cfg, _ = TRAINS[case]()
    ref_losses, ref_state = reference(model, cfg["batch"]["gradient_accumulation_steps"])
    for rank, res in enumerate(results):
        assert "error" not in res[case], f"rank {rank}: {res[case]['error']}"
        for a, b in zip(res[case]["losses"], ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (case, res[case]["losses"], ref_losses)
    state = results[0][case]["state"]
    for k, v in ref_state.items():
        assert (state[k] - v).abs().max().item() <= 1e-5, f"{case}: {k}"


@pytest.mark.parametrize("case, names, declare", [
    ("experts-rule-off", r"'experts\.\d\.0', 'experts\.\d\.0'", r"zeroplug.set_leaf_modules\(model, \[model.experts\]\)"),
    ("skip", r"'extra', 'head'", r"zeroplug.set_leaf_modules\(model, \[model.extra, model.head\]\)"),
    ("swap", r"'a', 'b'", r"zeroplug.set_leaf_modules\(model, \[model.a, model.b\]\)"),
])
def test_ranks_on_different_paths_all_stop_with_one_error(case, names, declare, results):
    """Each rank is about to gather a different module's unit in the first forward."""
    import re
    errors = [res[case].get("error") for res in results]
    assert errors[0] and errors[0] == errors[1], errors        # every rank, the same line
    line = errors[0]
    assert "\n" not in line
    assert re.search(r"rank 0 would run all_gather of unit \d+ \([\w.]+\) in step 1 \(micro-step 1 of 1\), "
                     r"forward; rank 1 would run all_gather of unit \d+", line), line
    assert re.search(names, line) and re.search(declare, line), line


def save_apart(rank, world):
    """Each rank saves into its own ``tempfile.mkdtemp()``; then the ranks disagree on the settings."""
    import tempfile
    from pathlib import Path
    out = {}
    engine = zeroplug.initialize(experts_model(), config(2))
    mine = tempfile.mkdtemp()
    try:
        engine.save_checkpoint(mine)
    except RanksDisagree as exc:
        out["save"] = str(exc)
    out["written"] = sorted(p.name for p in Path(mine).iterdir())
    try:
        zeroplug.initialize(experts_model(), config(2, accumulation=1 + rank))
    except RanksDisagree as exc:
        out["settings"] = str(exc)
    return out


def test_different_checkpoint_directories_and_settings_are_named():
    """A checkpoint directory made by tempfile.mkdtemp() on each rank: every rank refuses the
    save, naming both directories and the fix, and nothing is written; different
    gradient_accumulation_steps: every rank refuses at initialize, naming the key and each
    rank's value (the fault matrix runs both under torchrun too)."""
    import re
    res = run_ranks(save_apart, WORLD, timeout=TIMEOUT)
    for r in res:
        assert re.search(r"the ranks passed different arguments to engine.save_checkpoint \(rank 0: '/[^']+', tag "
                         r"None; rank 1: '/[^']+', tag None\).*same directory.*tempfile.mkdtemp\(\)", r["save"]), r
        assert r["save"] == res[0]["save"]
        assert r["written"] == []
        assert re.search(r"batch.gradient_accumulation_steps = 1 on rank 0, 2 on rank 1", r["settings"]), r


def test_a_module_skipped_after_it_was_gathered_ahead_stops_before_the_backward(results):
    """In the third step rank 1 skips ``extra``, whose unit stage 3 gathered ahead on every rank
    (as the forwards before went): the forwards issue the same gathers, but the backwards would
    not; every rank stops before its backward gathers anything, naming the forwards' modules and
    ``extra``."""
    import re
    errors = [res["skip-later"].get("error") for res in results]
    assert errors[0] and errors[0] == errors[1], errors
    line = errors[0]
    assert re.search(r"the ranks' forwards ran different modules \(rank 0 ran 'emb', 'a, b'?.*'extra'.*; rank 1 "
                     r"ran .*\) and their backwards would gather and reduce different units", line) or \
        re.search(r"the ranks' forwards ran different modules \(rank 0 ran .*'extra'.*; rank 1 ran", line), line
    assert "zeroplug.set_leaf_modules(model, [model.extra])" in line, line
