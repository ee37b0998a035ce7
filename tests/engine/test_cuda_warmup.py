"""The CUDA warm-up ``initialize`` runs (zeroplug.plugins.warmup): what it plans, that it runs
on throw-away tensors only, and (on a GPU) that training is bit-for-bit the same with it."""
import pytest
import torch

from zeroplug.plugins.warmup import MAX_OUTPUT_BYTES, MAX_SHAPES, plan, run_plan
from zeroplug.errors import ConfigError
from zeroplug.plugins.workload.models import GPT, get_preset
from tests.support.toy import ToyNet, engine_losses


def test_plan_has_each_linear_shape_once_and_cuts_rows_for_a_big_head():
    model = GPT(get_preset("char-tiny"))
    d = model.cfg.d_model
    shapes = plan(model, torch.bfloat16, 8192)
    keys = [s[:3] for s in shapes]
    assert len(keys) == len(set(keys))
    assert set(keys) == {(m.in_features, m.out_features, m.bias is not None)
                         for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert all(r == 8192 for *_, r in shapes)          # small shapes keep all rows
    head = torch.nn.Sequential(torch.nn.Linear(d, 50257, bias=False), torch.nn.Linear(d, d))
    (n_in, n_out, _, r), small = plan(head, torch.bfloat16, 8192)
    assert r * n_out * 2 <= MAX_OUTPUT_BYTES < (r + 1) * n_out * 2
    assert small[3] == 8192


def test_plan_is_bounded_for_many_adapters():
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8 + i) for i in range(3 * MAX_SHAPES)])
    assert len(plan(model, torch.float32, 16)) == MAX_SHAPES


def test_run_plan_touches_no_parameter():
    model = ToyNet()
    before = [p.detach().clone() for p in model.parameters()]
    shapes = plan(model, torch.float32, 64)
    assert run_plan(shapes, torch.float32, torch.device("cpu")) == len(shapes) > 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_warm_up_rows_is_validated():
    import zeroplug
    with pytest.raises(ConfigError, match="warm_up_rows"):
        zeroplug.load_config({"batch": {"warm_up_rows": -1}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_training_is_the_same_with_and_without_the_warm_up(stage):
    def losses(rows):
        cfg = {"zero": {"plugin": stage}, "precision": {"plugin": "bf16"}, "monitor": {"plugin": "none"},
               "optimizer": {"plugin": "adamw", "lr": 1e-2}, "batch": {"micro_batch_size": 8, "warm_up_rows": rows}}
        return engine_losses(ToyNet, 6, 8, cfg, device="cuda")[0]

    assert losses(4096) == losses(0)


def _collectives_worker(rank, world):
    import torch.distributed as dist
    from zeroplug.comm import Comm
    from zeroplug.plugins.warmup import warm_up_collectives
    comm = Comm()
    n = warm_up_collectives(comm, torch.device("cpu"), (torch.bfloat16, torch.float32, torch.float32))
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)                   # the ranks still agree on the next collective
    return n, t.tolist()


def test_every_rank_runs_the_same_collectives():
    from tests.support.distributed import run_ranks
    results = run_ranks(_collectives_worker, 2)
    assert [r[0] for r in results] == [12, 12]        # 2 dtypes x 2 sizes x 3 collectives
    assert all(r[1] == [3.0] * 4 for r in results)
