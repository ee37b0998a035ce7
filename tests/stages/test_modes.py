"""Every way the stages and the host tier work is decided once, at setup, into objects
(zeroplug.modes): the gradient sink (grad_sinks.py), each unit's parameter source
(param_sources.py), where the states step (offload.py), what stage 3 prefetches
(prefetch.py) and the host tier's copies, publisher, landing, sub-group step and schedule
(offload_cpu/stepping.py).

The combinations are listed below with the objects each must get, by the rules the modules
document; each is built (one rank in this process, a few on two gloo ranks), checked, and
trained one optimizer step, which must match single-process torch AdamW."""
from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, batches, build_engine, reference_losses, global_step

GLOBAL_BATCH = 8
LR, WEIGHT_DECAY = 1e-2, 0.01
# one step from the same initial weights: fp32 differs from torch only in the order of sums;
# bf16 by the rounding of the weights and activations (test_stage_equivalence.py's bounds)
TOL = {"fp32": (1e-5, 1e-5, 1e-5), "bf16": (1e-2, 1e-1, 6e-3)}    # loss rtol, param max, param mean


def config(stage, prec="fp32", offload=False, gas=1, world=1, zero=None, cpu=None, params=False,
           optimizer=None, foreach=False, frozen=False) -> dict:
    cfg = {"zero": {"plugin": f"stage{stage}", "reduce_bucket_size": 700, **(zero or {})},
           "precision": {"plugin": prec},
           "optimizer": {"plugin": optimizer or ("cpu_adam" if offload else "adamw"), "lr": LR,
                         "weight_decay": WEIGHT_DECAY},
           "batch": {"micro_batch_size": GLOBAL_BATCH // (gas * world), "gradient_accumulation_steps": gas,
                     "steps_per_print": 10_000},
           "monitor": {"plugin": "none"}, "scheduler": {"plugin": "none"}}
    if foreach:     # torch's foreach AdamW: the engine multiplies the gradients in place
        cfg["optimizer"]["implementation"] = "foreach"
    if stage == 3:
        cfg["zero"].setdefault("stage3_param_persistence_threshold", 30)
    if offload:
        cfg["offload"] = {"optimizer": {"plugin": "cpu", **(cpu or {})}}
        if params:
            cfg["offload"]["param"] = {"plugin": "cpu"}
    return cfg


def expected(stage, prec="fp32", offload=False, gas=1, world=1, zero=None, cpu=None, params=False,
             optimizer=None, foreach=False, frozen=False) -> dict:
    """The objects a run of this configuration gets, by the rules the mode modules document."""
    zero, cpu = zero or {}, cpu or {}
    from_masters = zero.get("stage3_params_from_masters", False)
    layout_world = 1 if stage == 0 or zero.get("shard_group_size") == 1 else world
    optimizer = optimizer or ("cpu_adam" if offload else "adamw")
    # the gradient sink
    if stage <= 1:
        sink = "FlatGradsToTier" if offload else "FlatGrads" if prec == "fp32" else "FlatGradsCopied"
    elif offload:
        sink = "ShardGradsToTier"
    elif world > 1:
        sink = "ShardGrads"
    else:
        scales = not foreach        # (adamw "auto": torch's fused kernel applies the multiplier)
        sink = "LowPrecisionSink" if prec != "fp32" and gas == 1 and scales else "DirectGrads"
    # the trainable units' parameter source
    lp_from_master = stage == 3 and (from_masters or (
        prec != "fp32" and not offload and not zero.get("stage3_low_precision_shards", False)))
    if lp_from_master:
        source = "MasterCast"           # (HostMaster on a GPU: the masters are apart)
    elif params:
        source = "TierShard"            # (UploadedShard on a GPU)
    else:
        source = "Whole" if layout_world == 1 else "DeviceShard"
    out = {"sink": sink, "source": source, "states": "Offloaded" if offload else "OnDevice"}
    if frozen:      # stage 3 shards frozen parameters in units of their own, never from a master
        out["frozen_source"] = "TierShard" if params else "Whole" if layout_world == 1 else "DeviceShard"
    if stage == 3:
        out["prefetch"] = "CastOnly" if layout_world == 1 and lp_from_master and not from_masters \
            else "FollowTrace"
    if offload:
        fused = optimizer == "cpu_adam"
        gathers = stage == 3 and source != "Whole"
        schedule = "Overlapped" if fused and gathers and cpu.get("overlap_step", True) else "Serial"
        out.update(copies="HostCopies",
                   publisher="NoPublish" if from_masters else "ScatterInMemory",
                   landing="DelayedLanding" if cpu.get("delayed_update") else "ExactLanding",
                   sub_group_step="StepOnly" if from_masters else "FusedPublish" if fused else "StepThenPublish",
                   schedule="DelayedFirst" if cpu.get("delayed_update") else schedule)
    return out


def chosen(engine) -> dict:
    part = engine.partitioner
    trainable = [u for u in part.all_units if u.trainable]
    sources = {type(u.source).__name__ for u in trainable}
    assert len(sources) == 1, sources
    out = {"sink": type(part.grads).__name__, "source": sources.pop(), "states": type(part.states).__name__}
    frozen = {type(u.source).__name__ for u in part.all_units if not u.trainable}
    if frozen:
        assert len(frozen) == 1, frozen
        out["frozen_source"] = frozen.pop()
    if hasattr(part, "prefetch"):
        out["prefetch"] = type(part.prefetch).__name__
    tier = engine.offload_optimizer
    if out["states"] == "Offloaded":
        out.update({k: type(getattr(tier, k)).__name__
                    for k in ("copies", "publisher", "landing", "sub_group_step", "schedule")})
    return out


def one_step(engine, rank=0, world=1) -> tuple[float, dict]:
    """One optimizer step on the global batch (this rank's micro-batches); the mean loss and
    the consolidated parameters."""
    gas = engine.config.batch.gradient_accumulation_steps
    x, y = next(batches(1, GLOBAL_BATCH))
    return global_step(engine, x, y, rank, world, gas), engine.consolidated_state_dict()


def _unique(cases) -> dict:
    out = dict(cases)
    assert len(out) == len(cases), "two cases share a name"
    return out


def _case(stage, prec="fp32", offload=False, gas=1, **kw):
    name = f"stage{stage}-{prec}" + ("-cpu" if offload else "") + (f"-gas{gas}" if gas > 1 else "")
    for k, v in kw.items():
        name += "".join(f"-{key}={val}" for key, val in v.items()) if isinstance(v, dict) else f"-{k}={v}"
    return name, dict(stage=stage, prec=prec, offload=offload, gas=gas, **kw)


#: one rank: the grid, then the variants that pick other objects
CASES = _unique(
    [_case(s, p, o, g) for s in range(4) for p in ("fp32", "bf16") for o in (False, True) for g in (1, 2)]
    + [_case(3, "bf16", zero={"stage3_low_precision_shards": True})]
    + [_case(3, p, True, params=True) for p in ("fp32", "bf16")]
    + [_case(3, "bf16", True, zero={"stage3_params_from_masters": True}, params=True)]
    + [_case(2, "bf16", True, optimizer="adamw"), _case(3, "bf16", True, optimizer="adamw", params=True)]
    + [_case(2, "bf16", foreach=True), _case(3, "bf16", foreach=True)]
    + [_case(3, "bf16", True, params=True, cpu={"overlap_step": False})]
    + [_case(2, "bf16", True, cpu={"delayed_update": True, "delayed_update_warmup": 4})]
    + [_case(3, "bf16", frozen=True),
       _case(3, "bf16", True, zero={"stage3_params_from_masters": True}, params=True, frozen=True)]
)
#: two ranks
CASES2 = _unique([
    _case(1, "bf16"), _case(2, "bf16"), _case(2, "fp32", gas=2), _case(3, "bf16"), _case(3, "fp32", gas=2),
    _case(3, "bf16", zero={"stage3_low_precision_shards": True}),
    _case(3, "bf16", zero={"shard_group_size": 1}),
    # units kept whole (persistent), gathered from zeroplug.init's shards before their masters exist
    _case(3, "bf16", zero={"stage3_param_persistence_threshold": 100}),
    _case(2, "bf16", True), _case(3, "bf16", True, params=True),
])


def model_fn(frozen: bool):
    """ToyNet, its embedding frozen when ``frozen``."""
    def make():
        model = ToyNet()
        model.emb.weight.requires_grad_(not frozen)
        return model
    return make


def build(kw, world=1):
    return build_engine(model_fn(kw.get("frozen", False)), config(world=world, **kw),
                        use_init=kw["stage"] == 3 and kw["prec"] == "bf16")


@pytest.fixture(scope="module")
def reference():
    """frozen -> (loss, parameters) of one step of torch AdamW."""
    out = {}
    for frozen in (False, True):
        losses, state = reference_losses(model_fn(frozen), 1, GLOBAL_BATCH, lr=LR, weight_decay=WEIGHT_DECAY)
        out[frozen] = losses[0], state
    return out


def check_against(reference, kw, loss, state, name) -> None:
    ref_loss, ref_state = reference[kw.get("frozen", False)]
    prec = kw["prec"]
    loss_rtol, atol, mean_atol = TOL[prec]
    assert abs(loss - ref_loss) <= loss_rtol * abs(ref_loss), (name, loss, ref_loss)
    assert set(state) == set(ref_state), name
    for k, ref in ref_state.items():
        diff = (state[k].float() - ref).abs()
        assert diff.max().item() <= atol and diff.mean().item() <= mean_atol, (name, k, diff.max().item())


@pytest.mark.parametrize("name", list(CASES))
def test_one_rank_chooses_and_trains(name, reference):
    kw = CASES[name]
    engine = build(kw)
    try:
        assert chosen(engine) == expected(**kw)
        loss, state = one_step(engine)
    finally:
        engine.close()
    check_against(reference, kw, loss, state, name)


def _two_ranks(rank, world):
    out = {}
    for name, kw in CASES2.items():
        engine = build(kw, world)
        got = chosen(engine)
        loss, state = one_step(engine, rank, world)
        engine.close()
        out[name] = (got, loss, state)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_ranks, 2)[0]


@pytest.mark.parametrize("name", list(CASES2))
def test_two_ranks_choose_and_train(name, two_ranks, reference):
    kw = CASES2[name]
    got, loss, state = two_ranks[name]
    assert got == expected(world=2, **kw)
    check_against(reference, kw, loss, state, name)


def test_a_mode_is_one_class_and_one_registration(reference):
    """A third party's sink, registered ahead of the built-ins, is what a matching run gets;
    the stage's files are untouched."""
    from zeroplug.plugins.zero.grad_sinks import GRAD_SINKS, DirectGrads

    class Counted(DirectGrads):
        taken = 0

        @classmethod
        def applies(cls, part, optimizer) -> bool:
            return DirectGrads.applies(part, optimizer) and part.pdtype == torch.float32

        def take(self, u, i, p) -> None:
            type(self).taken += 1
            super().take(u, i, p)

    GRAD_SINKS.register(Counted, before=GRAD_SINKS.classes[0])
    try:
        engine = build(CASES["stage2-fp32"])
        assert type(engine.partitioner.grads) is Counted
        loss, state = one_step(engine)
        engine.close()
    finally:
        GRAD_SINKS.classes.remove(Counted)
    assert Counted.taken == sum(1 for _ in ToyNet().parameters())
    check_against(reference, CASES["stage2-fp32"], loss, state, "Counted")
    engine = build(CASES["stage2-fp32"])
    assert type(engine.partitioner.grads) is DirectGrads
    engine.close()
