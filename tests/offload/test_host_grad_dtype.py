"""The offloaded gradient shard in the model's dtype (``[offload.optimizer] grad_dtype``):
used only where it holds the reduced gradient exactly, and then training is bit for bit
the same as with an fp32 shard."""
import pytest
import torch

from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, engine_losses

STEPS = 5


def _cfg(stage, prec, grad_dtype, world, reduce=None, ratio=0.0, gas=1):
    c = {"zero": {"plugin": stage, "reduce_bucket_size": 500, "sub_group_size": 300,
                  "stage3_param_persistence_threshold": 30},
         "precision": {"plugin": prec},
         "optimizer": {"plugin": "cpu_adam", "lr": 1e-2, "weight_decay": 0.01},
         "batch": {"micro_batch_size": 8 // world // gas, "gradient_accumulation_steps": gas,
                   "gradient_clipping": 0.5},
         "offload": {"optimizer": {"plugin": "cpu", "grad_dtype": grad_dtype, "gpu_step_ratio": ratio}},
         "monitor": {"plugin": "none"}}
    if reduce:
        c["precision"]["reduce_dtype"] = reduce
    return c


CASES = [("stage2", "bf16", None, 0.0), ("stage3", "bf16", None, 0.0), ("stage3", "bf16", None, 0.5),
         ("stage1", "fp16", None, 0.0), ("stage3", "bf16", "bf16", 0.0), ("stage2", "bf16", "fp32", 0.0)]


def _run(rank, world):
    out = {}
    for stage, prec, reduce, ratio in CASES:
        for gd in ("fp32", "auto"):
            losses, eng = engine_losses(ToyNet, STEPS, 8, _cfg(stage, prec, gd, world, reduce, ratio), rank, world)
            eng.partitioner.wait_optimizer()
            out[(stage, prec, reduce, ratio, gd)] = (
                losses, [t.detach().clone() for t in eng.partitioner.master_params()],
                eng.partitioner.master_params()[0].grad.dtype)
            eng.close()
    losses, eng = engine_losses(ToyNet, 2, 8, _cfg("stage2", "bf16", "auto", world, gas=2), rank, world)
    out["gas"] = eng.partitioner.master_params()[0].grad.dtype
    eng.close()
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def results(request):
    return request.param, run_ranks(_run, request.param)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_model_dtype_gradients_are_exact(results, case):
    world, res = results
    stage, prec, reduce, ratio = case
    default_reduce = {"bf16": "fp32", "fp16": "fp16"}[prec]
    exact = world == 1 or (reduce or default_reduce) == prec
    for r in res:
        l32, m32, d32 = r[(*case, "fp32")]
        la, ma, da = r[(*case, "auto")]
        assert d32 == torch.float32
        assert da == ({"bf16": torch.bfloat16, "fp16": torch.float16}[prec] if exact else torch.float32)
        assert la == l32
        for a, b in zip(m32, ma):
            assert torch.equal(a, b)


def test_accumulation_keeps_fp32(results):
    for r in results[1]:
        assert r["gas"] == torch.float32
