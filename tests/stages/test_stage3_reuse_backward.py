"""Stage 3 keeps the tail of the forward gathered for the backward that follows
(``stage3_max_reuse_distance`` counts the backward, as in DeepSpeed): a unit whose next
use, in the recorded order and then backward in reverse, lies within the distance is
not freed after its forward; everything is freed after the backward; values are the
same whatever the distance. On 2 ranks (at world size 1 nothing is sharded)."""
import pytest
import torch

from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, batches

WORLD = 2


def _engine(distance):
    import zeroplug
    cfg = {"zero": {"plugin": "stage3", "stage3_param_persistence_threshold": 0,
                    "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": distance},
           "precision": {"plugin": "fp32"}, "optimizer": {"plugin": "adamw", "lr": 1e-2},
           "batch": {"micro_batch_size": 8 // WORLD}, "monitor": {"plugin": "none"}}
    torch.manual_seed(0)
    return zeroplug.initialize(ToyNet(), cfg, device="cpu")


def _job(rank, world, distances):
    out = {}
    for d in distances:
        e = _engine(d)
        held, losses = [], []
        for step, (x, y) in enumerate(batches(4, 8)):
            per = 8 // world
            loss = e(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
            held.append([u.index for u in e.partitioner.units if u.state != "free"])
            e.backward(loss)
            assert all(u.state == "free" for u in e.partitioner.units if not u.persistent), "after backward"
            e.step()
            losses.append(loss.item())
        out[d] = {"held": held, "losses": losses, "order": list(e.partitioner.trace_cur),
                  "numel": {u.index: u.numel for u in e.partitioner.units},
                  "sharded": [u.index for u in e.partitioner.units if not u.persistent],
                  "masters": [t.detach().clone() for t in e.partitioner.master_params()]}
        e.close()
    return out


@pytest.fixture(scope="module")
def results():
    probe = run_ranks(_job, WORLD, [0])[0][0]
    last, second = probe["order"][-1], probe["order"][-2]
    tight = 2 * probe["numel"][last]        # exactly the last two
    return run_ranks(_job, WORLD, [0, tight, int(1e9)]), tight


def test_tail_kept_within_the_distance(results):
    res, tight = results
    for r in res:
        order, sharded = r[0]["order"], r[0]["sharded"]
        assert len(sharded) == len(set(order)) >= 3
        last, second = order[-1], order[-2]
        # the first forward has no recorded order: nothing kept
        assert all(r[d]["held"][0] == [] for d in r)
        for step in range(1, 4):
            assert r[0]["held"][step] == [last]                              # reused at once
            assert sorted(r[tight]["held"][step]) == sorted([last, second])  # the one before: 2 x last
            assert sorted(r[int(1e9)]["held"][step]) == sorted(set(order))   # the whole model fits


def test_same_values_whatever_the_distance(results):
    res, tight = results
    for r in res:
        for d in (tight, int(1e9)):
            assert r[d]["losses"] == r[0]["losses"]
            assert all(torch.equal(a, b) for a, b in zip(r[d]["masters"], r[0]["masters"]))
