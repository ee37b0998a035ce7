"""[zero] options that change how collectives run, not what they compute: every variant
trains exactly as the default does (2 ranks, gloo)."""
import pytest

from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, engine_losses

VARIANTS = {
    "default": {},
    "allgather_bucket_size=1": {"allgather_bucket_size": 1},     # one unit's gather in flight at a time
    "reduce_scatter=false": {"reduce_scatter": False},            # all-reduce, keep this rank's part
    "overlap_comm=false": {"overlap_comm": False},                # wait for each bucket's reduction
    "reduce_bucket_size=auto": {"reduce_bucket_size": "auto"},
}


def _job(rank, world):
    out = {}
    for stage in ("stage1", "stage2", "stage3"):
        for name, extra in VARIANTS.items():
            cfg = {"zero": {"plugin": stage, "reduce_bucket_size": 500, **extra},
                   "optimizer": {"plugin": "adamw", "lr": 1e-2}, "batch": {"micro_batch_size": 4},
                   "monitor": {"plugin": "none"}}
            out[(stage, name)] = engine_losses(ToyNet, 6, 8, cfg, rank, world)[0]
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_job, 2)[0]


@pytest.mark.parametrize("stage", ["stage1", "stage2", "stage3"])
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "default"])
def test_variant_trains_like_default(results, stage, variant):
    base, got = results[(stage, "default")], results[(stage, variant)]
    # the same sums in the same order, except all-reduce vs reduce-scatter (rounding)
    tol = 1e-6 if variant == "reduce_scatter=false" else 0.0
    assert max(abs(a - b) / abs(a) for a, b in zip(base, got)) <= tol
