"""zero.stage3_params_from_masters on a GPU: gathers upload the fp32 masters in chunks and
cast them on the device; the values equal the param tier's, and the host holds no
model-dtype shard. Skipped without CUDA."""
import pytest
import torch

import zeroplug
from tests.support.toy import ToyNet, batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(flag: bool, chunk: int | None = None):
    from zeroplug.plugins.zero import unit
    old = unit.UPLOAD_CHUNK
    if chunk:
        unit.UPLOAD_CHUNK = chunk       # several chunks per unit
    try:
        cfg = {"batch": {"micro_batch_size": 8, "gradient_clipping": 1.0, "steps_per_print": 1000},
               "precision": {"plugin": "bf16"},
               "zero": {"plugin": "stage3", "stage3_params_from_masters": flag,
                        "stage3_param_persistence_threshold": 0},
               "optimizer": {"plugin": "cpu_adam", "lr": 1e-2, "state_dtype": "int8", "while_building": "wait"},
               "offload": {"optimizer": {"plugin": "cpu"}, "param": {"plugin": "cpu"}},
               "monitor": {"plugin": "none"}}
        torch.manual_seed(0)
        with zeroplug.init(cfg, device="cuda"):
            model = ToyNet(d=256, hidden=1024)
        e = zeroplug.initialize(model, cfg, device="cuda")
        losses = []
        for x, y in batches(5, 8):
            loss = e(x.cuda(), y.cuda())
            e.backward(loss)
            e.step()
            losses.append(loss.item())
        e.partitioner.wait_optimizer()
        masters = [m.detach().clone() for m in e.partitioner.master_params()]
        report = e.memory_report()
        e.close()
        return losses, masters, report
    finally:
        unit.UPLOAD_CHUNK = old


def test_gathered_from_masters_equals_the_param_tier():
    la, ma, ra = _run(False)
    lb, mb, rb = _run(True, chunk=1000)
    assert la == lb
    assert all(torch.equal(x, y) for x, y in zip(ma, mb))
    assert ra["host"].get("lp_params", 0) > 0 and rb["host"].get("lp_params", 0) == 0
