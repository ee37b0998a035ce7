"""Training with the optimizer states on "NVMe" (swap files in a temporary directory)
equals the in-memory run exactly (issue E), stages 1-3 on 1 and 2 ranks."""
import os

import pytest
import torch

import zeroplug
from distributed import run_ranks
from toy import ToyNet, engine_losses

STAGES = ["stage1", "stage2", "stage3"]


def _cfg(stage, tier, world, path=None, pipelined=True, prec="fp32"):
    cfg = {"zero": {"plugin": stage, "reduce_bucket_size": 400, "sub_group_size": 900},
           "precision": {"plugin": prec}, "optimizer": {"plugin": "adamw", "lr": 1e-2, "weight_decay": 0.01},
           "batch": {"micro_batch_size": 8 // world, "gradient_clipping": 0.5}, "monitor": {"plugin": "none"},
           "offload": {"optimizer": {"plugin": tier}}}
    if tier == "nvme":
        cfg["offload"]["optimizer"].update(nvme_path=path, buffer_count=2,
                                           pipeline_read=pipelined, pipeline_write=pipelined)
    return cfg


def _job(rank, world, path):
    out = {}
    for stage in STAGES:
        for prec in ("fp32", "bf16"):
            ref, e0 = engine_losses(ToyNet, 8, 8, _cfg(stage, "cpu", world, prec=prec), rank, world)
            for pipelined in (True, False):
                losses, eng = engine_losses(ToyNet, 8, 8, _cfg(stage, "nvme", world, path, pipelined, prec),
                                            rank, world)
                part = eng.partitioner
                assert part.swap is not None and len(part.master_params()) > 1
                # between steps every sub-group's master and moments live only in files
                freed = all(t.untyped_storage().size() == 0 for t in part.master_params())
                moments = [v for t in part.master_params() for v in eng.optimizer.state[t].values()
                           if v.dim() > 0]
                freed = freed and moments and all(v.untyped_storage().size() == 0 for v in moments)
                sd = eng.consolidated_state_dict()
                sd0 = e0.consolidated_state_dict()
                same_params = sd is None or all(torch.equal(sd[k], sd0[k]) for k in sd)
                eng.close()
                out[(stage, prec, pipelined)] = (losses == ref, same_params, freed)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_nvme_equals_in_memory_exactly(world, tmp_path):
    res = run_ranks(_job, world, str(tmp_path))
    for rank_res in res:
        for key, (same_losses, same_params, freed) in rank_res.items():
            assert same_losses, f"losses differ {key}"
            assert same_params, f"parameters differ {key}"
            assert freed, f"states not swapped out between steps {key}"
    assert os.listdir(tmp_path) == [], "swap files left behind after close()"


def test_param_nvme_is_rejected_clearly(tmp_path):
    cfg = _cfg("stage3", "nvme", 1, str(tmp_path))
    cfg["offload"]["param"] = {"plugin": "nvme", "nvme_path": str(tmp_path)}
    with pytest.raises(zeroplug.ConfigError, match="not wired into training yet"):
        zeroplug.load_config(cfg)


def test_nvme_checkpoint_resume_exact_and_cross_tier(tmp_path):
    """Save with the optimizer on NVMe, resume on NVMe and on the cpu tier: the losses
    continue exactly as an uninterrupted run's."""
    from toy import batches
    swap, ck = str(tmp_path / "swap"), str(tmp_path / "ck")
    os.makedirs(swap)

    def train(engine, data, n):
        out = []
        for _ in range(n):
            x, y = next(data)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    def build(tier):
        torch.manual_seed(0)
        return zeroplug.initialize(ToyNet(), _cfg("stage2", tier, 1, swap))

    e = build("nvme")
    full = train(e, batches(8, 8), 8)
    e.close()
    eng = build("nvme")
    data = batches(8, 8)
    first = train(eng, data, 4)
    eng.save_checkpoint(ck)
    eng.close()
    assert os.listdir(swap) == []
    for tier in ("nvme", "cpu"):
        eng2 = build(tier)
        eng2.load_checkpoint(ck)
        rest = batches(8, 8)
        for _ in range(4):
            next(rest)
        assert first + train(eng2, rest, 4) == full, tier
        eng2.close()
    assert os.listdir(swap) == []
