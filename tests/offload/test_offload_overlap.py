"""The overlapped offload step: the CPU steps sub-groups on a worker thread while
the next forward runs; every parameter and loss equals the serial step's, and an error
raised in the worker reaches the caller at the next use of the states."""
import pytest
import torch

from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, batches, engine_losses

STEPS = 8


class SharedNet(ToyNet):
    """ToyNet with one more block applied twice (once after each block): a unit that the
    forward gathers twice, which a prefetch may find still gathered the first time."""

    def __init__(self):
        super().__init__()
        d = self.emb.embedding_dim
        self.shared = torch.nn.Sequential(torch.nn.Linear(d, 40), torch.nn.GELU(), torch.nn.Linear(40, d))

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
            h = h + self.shared(h)
        logits = self.head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


def _cfg(prec, overlap, world):
    return {"zero": {"plugin": "stage3", "reduce_bucket_size": 500, "sub_group_size": 700,
                     "stage3_param_persistence_threshold": 30},
            "precision": {"plugin": prec}, "optimizer": {"plugin": "cpu_adam", "lr": 1e-2, "weight_decay": 0.01},
            "batch": {"micro_batch_size": 8 // world, "gradient_clipping": 0.5},
            "offload": {"optimizer": {"plugin": "cpu", "overlap_step": overlap}},
            "monitor": {"plugin": "none"}}


def _run(rank, world):
    out = {}
    for prec in ("fp32", "bf16"):
        for overlap in (False, True):
            losses, eng = engine_losses(ToyNet, STEPS, 8, _cfg(prec, overlap, world), rank, world)
            off = eng.offload_optimizer
            out[(prec, overlap, "steps")] = off.overlapped_steps
            out[(prec, overlap)] = (losses, eng.consolidated_state_dict(),
                                    [t.detach().clone() for t in eng.partitioner.master_params()])
            eng.close()
    # one rank's CPU step slower than the other's: every rank makes the same prefetch
    # decisions (by program order, not by its own step's progress)
    import time

    def make_slow(eng):
        step_param = eng.optimizer.step_param

        def slowed(*a, **k):
            if rank == 1:
                time.sleep(0.02)
            return step_param(*a, **k)
        eng.optimizer.step_param = slowed
    from zeroplug.plugins.zero.unit import Unit
    start_gather, gathers = Unit.start_gather, []

    def logged(unit, *a, **k):         # the order of this rank's gathers (collectives)
        gathers.append(unit.index)
        return start_gather(unit, *a, **k)
    for overlap in (False, True):
        gathers.clear()
        Unit.start_gather = logged
        try:
            losses, eng = engine_losses(SharedNet, STEPS, 8, _cfg("fp32", overlap, world), rank, world,
                                        after_init=make_slow)
        finally:
            Unit.start_gather = start_gather
        out[("slowed", overlap)] = (losses, eng.consolidated_state_dict())
        out[("prefetches", overlap)] = eng.partitioner.prefetch_count
        out[("gathers", overlap)] = list(gathers)
        eng.close()
    # a failure inside the worker: raised at the next use, not lost
    losses, eng = engine_losses(ToyNet, 2, 8, _cfg("fp32", True, world), rank, world)

    def boom(*a, **k):
        raise ValueError("boom in sub-group step")

    eng.partitioner.wait_optimizer()      # step 2 may still be running: let it finish first
    eng.optimizer.step_param = boom
    x, y = next(iter(batches(1, 8)))
    per = 8 // world
    xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    eng.backward(eng(xs, ys))
    eng.step()
    pending = eng.partitioner.offload.pending
    try:
        eng(xs, ys)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    out["pending_after_step"] = pending
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_run, 2)


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_overlapped_equals_serial(results, prec):
    for res in results:
        (l0, sd0, m0), (l1, sd1, m1) = res[(prec, False)], res[(prec, True)]
        assert res[(prec, False, "steps")] == 0
        assert res[(prec, True, "steps")] == STEPS        # every step ran overlapped
        assert l0 == l1                                    # bit for bit
        for a, b in zip(m0, m1):
            assert torch.equal(a, b)
    sd0, sd1 = results[0][(prec, False)][1], results[0][(prec, True)][1]
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), k


def test_ranks_stepping_at_different_speeds_gather_alike(results):
    """Rank 1's CPU step is slower than rank 0's, in a model with a module used twice: both
    ranks start the same gathers in the same order and prefetch the same units (decided by
    program order; decided by each rank's own progress they prefetched 63 and 35 times, and
    a two-GPU job hung), and the overlapped step still equals the serial one."""
    assert results[0][("gathers", True)] == results[1][("gathers", True)]
    assert results[0][("prefetches", True)] == results[1][("prefetches", True)] > 0
    for res in results:
        assert res[("slowed", False)][0] == res[("slowed", True)][0]
    sd0, sd1 = results[0][("slowed", False)][1], results[0][("slowed", True)][1]
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), k


def test_worker_error_reaches_the_caller(results):
    for res in results:
        assert res["pending_after_step"]                   # engine.step() returned mid-step
        assert res["error"] == "boom in sub-group step"
