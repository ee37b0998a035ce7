"""The cpu tier's speculative step (``speculative_step``): sub-groups stepped during the
backward, kept when the step neither clips nor overflows, restored and redone (or undone)
when it does. Every value must equal the non-speculative path's bit for bit: losses,
fp32 masters, Adam's moments and step counts, the model-dtype parameters and the lr;
and the tier's counters show which path ran."""
import math

import pytest
import torch

from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, batches

STEPS = 5
CLIP_SOME = 0.7      # between the toy run's gradient norms: some steps clip, some do not


def _cfg(stage, spec, prec="bf16", clip=0.0, gas=1, world=1, overlap=True):
    zero = {"plugin": stage, "reduce_bucket_size": 500, "sub_group_size": 700}
    if stage == "stage3":
        zero["stage3_param_persistence_threshold"] = 30
    return {"zero": zero,
            "precision": {"plugin": prec}, "optimizer": {"plugin": "cpu_adam", "lr": 1e-2, "weight_decay": 0.01},
            "scheduler": {"plugin": "warmup", "warmup_num_steps": 4, "warmup_min_lr": 1e-3},
            "batch": {"micro_batch_size": 8 // gas // world, "gradient_clipping": clip,
                      "gradient_accumulation_steps": gas},
            "offload": {"optimizer": {"plugin": "cpu", "speculative_step": spec, "overlap_step": overlap}},
            "monitor": {"plugin": "none"}}


def _train(cfg, rank=0, world=1, inf_at=(), eval_at=(), settle=True):
    """STEPS optimizer steps; ``inf_at``: steps whose loss is multiplied by inf (an fp16
    overflow); ``eval_at``: steps with a no-grad forward between the backward and the step.
    ``settle``: let the speculative jobs queued in the backward finish before the step (else
    those the worker has not begun are dropped, and the counts depend on timing)."""
    import zeroplug
    torch.manual_seed(0)
    eng = zeroplug.initialize(ToyNet(), cfg)
    gas = eng.gradient_accumulation_steps
    per = 8 // gas // world
    out = {"losses": [], "lrs": [], "evals": []}
    data = iter(batches(STEPS * gas, 8 // gas * 1))
    for step in range(STEPS):
        for _ in range(gas):
            x, y = next(data)
            xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
            loss = eng(xs, ys)
            eng.backward(loss * math.inf if step in inf_at else loss)
            out["losses"].append(loss.item())
        spec = eng.offload_optimizer.speculation
        if settle and spec is not None and spec.window is not None:
            for f in spec.window.futures:
                f.result()
        if step in eval_at:
            with torch.no_grad():
                out["evals"].append(eng(xs, ys).item())
        eng.step()
        out["lrs"].append(eng.get_lr())
    eng.partitioner.wait_optimizer()
    out["masters"] = [t.detach().clone() for t in eng.partitioner.master_params()]
    out["states"] = [{k: v.clone() if torch.is_tensor(v) else v for k, v in eng.optimizer.state[p].items()}
                     for p in eng.partitioner.master_params()]
    out["params"] = eng.consolidated_state_dict()
    out["skipped"] = eng.skipped_steps
    spec = eng.offload_optimizer.speculation
    out["spec"] = None if spec is None else (spec.speculated_steps, spec.speculated_groups, spec.rollbacks,
                                             spec.rolled_back_groups)
    eng.close()
    return out


def _same(a, b):
    assert a["losses"] == b["losses"]
    assert a["evals"] == b["evals"]
    assert a["lrs"] == b["lrs"]
    assert a["skipped"] == b["skipped"]
    assert len(a["masters"]) == len(b["masters"])
    for x, y in zip(a["masters"], b["masters"]):
        assert torch.equal(x, y)
    for sa, sb in zip(a["states"], b["states"]):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    if a["params"] is not None:
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k


# -- one rank (in this process) ------------------------------------------------------------
@pytest.mark.parametrize("stage", ["stage2", "stage3"])
@pytest.mark.parametrize("prec", ["bf16", "fp32"])
def test_kept_when_not_clipped(stage, prec):
    """No clipping, no overflow: every step keeps what the backward stepped."""
    plain = _train(_cfg(stage, False, prec))
    spec = _train(_cfg(stage, True, prec))
    _same(plain, spec)
    assert plain["spec"] is None
    steps, groups, rollbacks, _ = spec["spec"]
    assert steps == STEPS and groups >= STEPS and rollbacks == 0


@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_redone_when_clipped(stage):
    """A tiny gradient_clipping clips every step: each speculative step is rolled back and
    redone with the clip factor."""
    plain = _train(_cfg(stage, False, clip=1e-3))
    spec = _train(_cfg(stage, True, clip=1e-3))
    _same(plain, spec)
    steps, groups, rollbacks, rolled = spec["spec"]
    assert steps == 0 and groups == 0
    assert rollbacks == STEPS and rolled >= STEPS


@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_clipping_some_steps(stage):
    """A clip threshold among the steps' norms (0.68-0.74 here): some steps kept, some redone."""
    plain = _train(_cfg(stage, False, clip=CLIP_SOME))
    spec = _train(_cfg(stage, True, clip=CLIP_SOME))
    _same(plain, spec)
    steps, _, rollbacks, _ = spec["spec"]
    assert steps + rollbacks == STEPS and steps > 0 and rollbacks > 0


@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_fp16_overflow_undone(stage):
    """An inf in the loss at steps 1 and 3: the step is skipped, and what the backward
    stepped is restored, published values included (the next forward reads them)."""
    plain = _train(_cfg(stage, False, "fp16"), inf_at=(1, 3))
    spec = _train(_cfg(stage, True, "fp16"), inf_at=(1, 3))
    _same(plain, spec)
    assert spec["skipped"] == 2
    steps, _, rollbacks, rolled = spec["spec"]
    assert rollbacks == 2 and rolled >= 2 and steps == STEPS - 2


@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_gradient_accumulation(stage):
    """Only the boundary micro-batch's gradients are final: with 2 micro-batches a step."""
    plain = _train(_cfg(stage, False, gas=2, clip=CLIP_SOME))
    spec = _train(_cfg(stage, True, gas=2, clip=CLIP_SOME))
    _same(plain, spec)
    steps, _, rollbacks, _ = spec["spec"]
    assert steps + rollbacks == STEPS and steps > 0 and rollbacks > 0


@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_jobs_not_begun_are_dropped(stage):
    """Without waiting for the worker, the step drops the jobs it had not begun and steps
    those sub-groups itself (no copy): the same values whichever way the timing fell."""
    plain = _train(_cfg(stage, False, clip=CLIP_SOME), settle=False)
    spec = _train(_cfg(stage, True, clip=CLIP_SOME), settle=False)
    _same(plain, spec)


def test_no_copy_where_host_memory_runs_short(monkeypatch):
    """A sub-group's copy is allocated at its first speculative step only while HOST_RESERVE
    stays available; short of that, it steps at the step (no speculation, same values)."""
    from zeroplug.plugins.offload_cpu import speculative
    plain = _train(_cfg("stage2", False))
    monkeypatch.setattr(speculative, "HOST_RESERVE", 1 << 60)
    spec = _train(_cfg("stage2", True))
    _same(plain, spec)
    assert spec["spec"] == (0, 0, 0, 0)


@pytest.mark.parametrize("clip", [0.0, 1e-3])
def test_compiled_kernel_sizes(clip):
    """Sub-groups large enough for cpu_adam's compiled kernel (the GPU machines' path; the
    toy's are stepped by the eager one): kept and redone steps equal the plain path's."""
    import zeroplug

    def run(spec):
        torch.manual_seed(0)
        cfg = _cfg("stage2", spec, clip=clip)
        cfg["zero"].update(reduce_bucket_size=200_000, sub_group_size=200_000)
        eng = zeroplug.initialize(ToyNet(d=256, hidden=512), cfg)
        for x, y in batches(3, 8):
            eng.backward(eng(x, y))
            w = eng.offload_optimizer.speculation.window if spec else None
            for f in (w.futures if w is not None else []):
                f.result()
            eng.step()
        big = max(m.numel() for m in eng.partitioner.master_params())
        kernel = eng.optimizer.implementation(torch.bfloat16, torch.bfloat16, big, 0.5)
        out = ([m.clone() for m in eng.partitioner.master_params()],
               [{k: v.clone() for k, v in eng.optimizer.state[m].items()} for m in eng.partitioner.master_params()],
               eng.offload_optimizer.speculation, kernel)
        eng.close()
        return out

    (m0, s0, _, kernel), (m1, s1, spec, _) = run(False), run(True)
    if kernel != "compile":
        pytest.skip("no compiled cpu_adam kernel on this machine")
    assert all(torch.equal(a, b) for a, b in zip(m0, m1))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(s0, s1) for k in a)
    assert (spec.rollbacks, spec.speculated_steps > 0) == ((3, False) if clip else (0, True))


def test_stage3_parameters_offloaded():
    """Parameter shards in host memory ([offload.param] cpu): the speculative step writes
    them directly; kept, redone or undone (overflow), they equal the plain path's."""
    def cfg(spec):
        c = _cfg("stage3", spec, "fp16", clip=CLIP_SOME)
        c["offload"]["param"] = {"plugin": "cpu"}
        return c
    plain = _train(cfg(False), inf_at=(2,))
    spec = _train(cfg(True), inf_at=(2,))
    _same(plain, spec)
    assert spec["spec"][2] >= 1


def test_forward_before_the_step_sees_no_speculation():
    """A no-grad forward between a boundary backward and its step reads the parameters of
    the last step, not speculated ones (the speculation is undone, then redone by the step)."""
    plain = _train(_cfg("stage2", False), eval_at=(1, 2))
    spec = _train(_cfg("stage2", True), eval_at=(1, 2))
    _same(plain, spec)
    assert spec["spec"][2] == 2


def test_serial_stage3_and_auto_off_on_cpu():
    """overlap_step = false (the serial stage-3 step) speculates alike; "auto" does not
    speculate on a CPU training device (the backward and the step share its cores)."""
    plain = _train(_cfg("stage3", False, overlap=False, clip=CLIP_SOME))
    spec = _train(_cfg("stage3", True, overlap=False, clip=CLIP_SOME))
    _same(plain, spec)
    assert spec["spec"][0] > 0
    auto = _train(_cfg("stage3", "auto"))
    assert auto["spec"] is None


def test_auto_follows_recent_steps():
    """"auto" speculates once the last 4 steps held (no clip, no overflow) and stops at the
    first that does not."""
    from zeroplug.plugins.offload_cpu.speculative import AUTO_CLEAN_STEPS, Speculation, Window, settings
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    spec = Speculation(None, "auto")
    seen = []
    for mult in [1.0] * AUTO_CLEAN_STEPS + [0.5, 1.0] + [1.0] * AUTO_CLEAN_STEPS:
        seen.append(spec.wanted())
        spec.window = Window(opt, 1.0, spec.wanted())
        spec.validate(opt, mult)        # nothing was stepped: only the verdict is recorded
    assert seen == [False] * 4 + [True] + [False] * 4 + [True]
    spec.window = Window(opt, 1.0, True)
    spec.window.settings = settings(opt)    # as the first speculative job records them
    opt.param_groups[0]["lr"] = 0.2     # changed settings: the guess did not hold either
    spec.validate(opt, 1.0)
    assert not spec.wanted()


def test_speculative_step_refused_with_delayed_update(caplog):
    cfg = _cfg("stage3", True)
    cfg["offload"]["optimizer"]["delayed_update"] = True
    with caplog.at_level("WARNING", logger="zeroplug"):
        out = _train(cfg)
    assert out["spec"] is None
    assert sum("speculative_step = true ignored" in r.message for r in caplog.records) == 1


# -- two ranks (gloo) ----------------------------------------------------------------------
def _ranks(rank, world):
    out = {}
    for stage in ("stage2", "stage3"):
        for case, kw, run in (("clip", {"clip": CLIP_SOME}, {}),
                              ("fp16", {"prec": "fp16"}, {"inf_at": (2,)}),
                              ("gas", {"gas": 2, "clip": CLIP_SOME}, {})):
            for spec in (False, True):
                out[(stage, case, spec)] = _train(_cfg(stage, spec, world=world, **kw), rank, world, **run)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_ranks, 2)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["stage2", "stage3"])
@pytest.mark.parametrize("case", ["clip", "fp16", "gas"])
def test_two_ranks_bit_identical(two_ranks, stage, case):
    """The norm is an all-reduce at the end of the backward; each rank speculates on its
    own shard, every rank reaches the same verdict, and kept or redone, the values equal
    the non-speculative run's."""
    for res in two_ranks:
        plain, spec = res[(stage, case, False)], res[(stage, case, True)]
        _same(plain, spec)
        steps, _, rollbacks, _ = spec["spec"]
        if case == "fp16":
            assert rollbacks == 1 and steps == STEPS - 1
        else:
            assert steps + rollbacks == STEPS and steps > 0 and rollbacks > 0
    assert two_ranks[0][(stage, case, True)]["spec"][:3:2] == two_ranks[1][(stage, case, True)]["spec"][:3:2]
