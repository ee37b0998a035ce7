"""The nvme tier's ``reuse_resident`` (plugins/offload_nvme/swap.py): the sub-group order alternates
each step and the last R = max(1, pipeline_read + pipeline_write) stepped sub-groups stay
in host memory, unwritten, for the next step. Values equal reuse off and the in-memory
tier bit for bit; the swapper moves exactly R sub-groups' bytes less each way per step;
at most 1 + pipeline_read + pipeline_write sub-groups are allocated during a step."""
import os
from contextlib import nullcontext

import pytest
import torch

import zeroplug
from tests.support.toy import ToyNet, batches, train_steps

STEPS = 6                   # 3 forward and 3 backward steps: both directions twice and more
PIPES = [(True, True), (True, False), (False, True), (False, False)]


def _cfg(tier, path=None, reuse=None, pipes=(True, True), prec="fp32", optimizer="adamw", stage="stage2"):
    cfg = {"zero": {"plugin": stage, "reduce_bucket_size": 400, "sub_group_size": 900},
           "precision": {"plugin": prec}, "optimizer": {"plugin": optimizer, "lr": 1e-2, "weight_decay": 0.01},
           "batch": {"micro_batch_size": 8, "gradient_clipping": 0.5}, "monitor": {"plugin": "none"},
           "offload": {"optimizer": {"plugin": tier}}}
    if tier == "nvme":
        cfg["offload"]["optimizer"].update(nvme_path=str(path), buffer_count=2, pipeline_read=pipes[0],
                                           pipeline_write=pipes[1])
        if reuse is not None:
            cfg["offload"]["optimizer"]["reuse_resident"] = reuse
    return cfg


def _build(cfg, seed=0):
    torch.manual_seed(seed)
    return zeroplug.initialize(ToyNet(), cfg, device="cpu")     # also on a machine with a GPU


def _resident(swap) -> list[int]:
    """Sub-groups with memory now (master or any element-wise state)."""
    return [k for k in range(len(swap.masters)) if any(t.untyped_storage().nbytes() > 0 for _, t in swap.tensors(k))]


def _states(engine) -> list[torch.Tensor]:
    """Every master and element-wise optimizer state, copied (all_resident: brings the
    swapped ones in and frees them again, leaves the resident ones as they are)."""
    part = engine.partitioner
    swap = getattr(engine.offload_optimizer, "swap", None)     # the nvme tier's
    with swap.all_resident(engine.optimizer) if swap is not None else nullcontext():
        out = []
        for t in part.master_params():
            out.append(t.detach().clone())
            out += [v.detach().clone() for _, v in sorted(engine.optimizer.state[t].items()) if v.dim() > 0]
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("prec,optimizer", [("fp32", "adamw"), ("bf16", "cpu_adam")])
def test_reuse_is_bit_exact(tmp_path, prec, optimizer):
    """Reuse on (every pipeline setting) == reuse off == the cpu tier, losses, parameters,
    masters and moments; all_resident and swap_out_all keep the resident dirty sub-groups."""
    ref = _build(_cfg("cpu", prec=prec, optimizer=optimizer))
    ref_losses = train_steps(ref, batches(STEPS, 8), STEPS)
    ref_sd, ref_states = ref.consolidated_state_dict(), _states(ref)
    ref.close()
    for pipes in PIPES:
        for reuse in (False, True):
            e = _build(_cfg("nvme", tmp_path, reuse, pipes, prec, optimizer))
            swap = e.offload_optimizer.swap
            n, keep = len(swap.masters), swap.kept()
            assert n >= 4 and keep == (max(1, sum(pipes)) if reuse else 0)
            data = batches(STEPS, 8)
            losses = train_steps(e, data, STEPS - 2)
            # the 4th step ran backward and kept 0 ... keep - 1: in memory, their files stale
            assert _resident(swap) == list(range(keep)), (pipes, reuse)
            assert sorted(swap.swapped) == list(range(keep, n)), (pipes, reuse)
            mid = _states(e)                    # all in, then out again: the kept ones stay
            assert _resident(swap) == list(range(keep)), (pipes, reuse)
            if reuse and pipes == (True, True):
                swap.swap_out_all()             # written (current values) and freed: read back next step
                assert _resident(swap) == [] and len(swap.swapped) == n
            losses += train_steps(e, data, 2)
            states = _states(e)
            assert losses == ref_losses, (pipes, reuse)
            sd = e.consolidated_state_dict()
            assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd), (pipes, reuse)
            assert _same(states, ref_states), (pipes, reuse)
            assert len(mid) == len(states)
            assert swap.reused == (0 if not reuse else keep * (STEPS - 1 - (pipes == (True, True))))
            e.close()
    assert os.listdir(tmp_path) == []


def _sg_bytes(swap, ks) -> int:
    return sum(12 * swap.masters[k].numel() for k in ks)       # fp32 master + exp_avg + exp_avg_sq


def test_reuse_moves_fewer_bytes_exactly(tmp_path):
    """Per step the swapper reads and writes exactly the kept sub-groups' bytes less."""
    per_step = {}
    for reuse in (False, True):
        e = _build(_cfg("nvme", tmp_path, reuse))
        swap, sw = e.offload_optimizer.swap, e.offload_optimizer.swap.swapper
        data, rows = batches(STEPS, 8), []
        for _ in range(STEPS):
            r0, w0 = sw.bytes_read, sw.bytes_written
            train_steps(e, data, 1)
            rows.append((sw.bytes_read - r0, sw.bytes_written - w0))
        per_step[reuse] = rows
        n = len(swap.masters)
        if reuse:
            assert swap.reused == 2 * (STEPS - 1)
        e.close()
    total = _sg_bytes(swap, range(n))
    off, on = per_step[False], per_step[True]
    # reuse off: the first step reads the masters (the moments are created in it), then everything
    assert off[0] == (total // 3, total) and all(r == (total, total) for r in off[1:])
    fwd_kept, bwd_kept = _sg_bytes(swap, (n - 2, n - 1)), _sg_bytes(swap, (0, 1))
    assert fwd_kept != bwd_kept                 # sub-groups of different sizes: the sets are checked
    for i, ((r_off, w_off), (r_on, w_on)) in enumerate(zip(off, on)):
        kept_now = fwd_kept if i % 2 == 0 else bwd_kept      # kept by this step (forward on even i)
        kept_before = 0 if i == 0 else (bwd_kept if i % 2 == 0 else fwd_kept)
        assert r_off - r_on == kept_before, i
        assert w_off - w_on == kept_now, i


@pytest.mark.parametrize("pipes", PIPES)
def test_reuse_peak_resident_within_pipeline(tmp_path, pipes):
    """Sub-groups allocated while one steps: at most 1 + pipeline_read + pipeline_write
    (the same peak as without reuse); between steps exactly the kept ones; the order
    alternates with reuse and is always forward without."""
    bound = 1 + int(pipes[0]) + int(pipes[1])
    for reuse in (False, True):
        e = _build(_cfg("nvme", tmp_path, reuse, pipes))
        swap = e.offload_optimizer.swap
        n, keep = len(swap.masters), swap.kept()
        peak, orders, between = [0], [], []
        orig = swap.step

        def step(optimizer, step_one, publish_done, orig=orig, swap=swap, peak=peak, orders=orders):
            orders.append([])

            def counted(k):
                peak[0] = max(peak[0], len(_resident(swap)))
                step_one(k)
                peak[0] = max(peak[0], len(_resident(swap)))    # the first step creates moments
                orders[-1].append(k)
            return orig(optimizer, counted, publish_done)

        swap.step = step
        data = batches(STEPS, 8)
        for _ in range(STEPS):
            train_steps(e, data, 1)
            between.append(_resident(swap))
        e.close()
        fwd = list(range(n))
        assert peak[0] == bound, (pipes, reuse, peak[0])
        if reuse:
            assert orders == [fwd if i % 2 == 0 else fwd[::-1] for i in range(STEPS)]
            assert between == [fwd[-keep:] if i % 2 == 0 else fwd[:keep] for i in range(STEPS)]
            assert keep == max(1, bound - 1)
        else:
            assert orders == [fwd] * STEPS and between == [[]] * STEPS


def test_checkpoint_with_resident_dirty_sub_groups(tmp_path):
    """Saved after a step that kept sub-groups in memory (their files stale), the checkpoint
    continues exactly as an uninterrupted run, into fresh engines with reuse on and off, the
    cpu tier, and a trained engine holding resident sub-groups of its own; the save leaves
    the kept sub-groups resident."""
    swap_dir, ck = tmp_path / "swap", tmp_path / "ck"
    swap_dir.mkdir()
    full_e = _build(_cfg("nvme", swap_dir, False, prec="bf16", stage="stage3"))
    full = train_steps(full_e, batches(8, 8), 8)
    full_sd = full_e.consolidated_state_dict()
    full_e.close()

    def rest(engine):
        data = batches(8, 8)
        for _ in range(3):
            next(data)
        out = train_steps(engine, data, 5)
        return out, engine.consolidated_state_dict()

    e = _build(_cfg("nvme", swap_dir, True, prec="bf16", stage="stage3"))
    first = train_steps(e, batches(8, 8), 3)
    swap = e.offload_optimizer.swap
    n = len(swap.masters)
    kept = _resident(swap)
    assert kept == [n - 2, n - 1] and all(k not in swap.swapped for k in kept)
    written = swap.swapper.bytes_written
    e.save_checkpoint(ck)
    assert _resident(swap) == kept and swap.swapper.bytes_written == written    # nothing written back
    assert first + rest(e)[0] == full           # the saving engine goes on (backward, from the kept ones)
    e.close()
    builds = [("nvme-reuse", lambda: _build(_cfg("nvme", swap_dir, True, prec="bf16", stage="stage3"), seed=3)),
              ("nvme", lambda: _build(_cfg("nvme", swap_dir, False, prec="bf16", stage="stage3"), seed=3)),
              ("cpu", lambda: _build(_cfg("cpu", prec="bf16", stage="stage3"), seed=3))]
    for name, build in builds:
        for trained in ((False, True) if name == "nvme-reuse" else (False,)):
            e2 = build()
            if trained:     # its own kept sub-groups (0 and 1, after 2 steps) are overwritten in memory
                train_steps(e2, batches(2, 8, seed=9), 2)
                assert _resident(e2.offload_optimizer.swap) == [0, 1]
            e2.load_checkpoint(ck)
            if trained:
                assert _resident(e2.offload_optimizer.swap) == [0, 1]
            losses, sd = rest(e2)
            assert first + losses == full, (name, trained)
            assert all(torch.equal(sd[k], full_sd[k]) for k in full_sd), (name, trained)
            e2.close()
    assert os.listdir(swap_dir) == []


def test_reuse_resident_is_optimizer_only(tmp_path):
    cfg = _cfg("nvme", tmp_path, stage="stage3")
    cfg["offload"]["param"] = {"plugin": "nvme", "nvme_path": str(tmp_path), "reuse_resident": True}
    with pytest.raises(zeroplug.ConfigError, match=r"offload\.param\.reuse_resident applies to "
                                                   r"\[offload\.optimizer\] only"):
        zeroplug.load_config(cfg)
    cfg["offload"]["param"]["reuse_resident"] = False        # any value: the key does not belong there
    with pytest.raises(zeroplug.ConfigError, match="reuse_resident"):
        zeroplug.load_config(cfg)
    # in [offload.optimizer]: accepted, default true
    del cfg["offload"]["param"]["reuse_resident"]
    assert zeroplug.load_config(cfg).slot("offload.optimizer").options.reuse_resident is True
    cfg["offload"]["optimizer"]["reuse_resident"] = False
    assert zeroplug.load_config(cfg).slot("offload.optimizer").options.reuse_resident is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("optimizer", ["adamw", "cpu_adam"])
@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_reuse_on_gpu_is_bit_exact(tmp_path, optimizer, stage):
    """Shards on the GPU: the publish path (staging buffers in turn, H2D events) with the
    alternating order equals reuse off and the cpu tier bit for bit."""
    from tests.support.toy import engine_losses
    torch.backends.cuda.matmul.allow_tf32 = False
    runs = {}
    for name, cfg in (("cpu", _cfg("cpu", prec="bf16", optimizer=optimizer, stage=stage)),
                      ("off", _cfg("nvme", tmp_path, False, prec="bf16", optimizer=optimizer, stage=stage)),
                      ("on", _cfg("nvme", tmp_path, True, prec="bf16", optimizer=optimizer, stage=stage))):
        losses, e = engine_losses(ToyNet, STEPS, 8, cfg, device="cuda")
        sd = {k: v.detach().cpu() for k, v in e.consolidated_state_dict().items()}
        runs[name] = (losses, sd, _states(e))
        if name == "on":
            assert e.offload_optimizer.swap.reused == 2 * (STEPS - 1)
        e.close()
    for name in ("off", "on"):
        assert runs[name][0] == runs["cpu"][0], name
        assert all(torch.equal(runs[name][1][k], v) for k, v in runs["cpu"][1].items()), name
        assert _same(runs[name][2], runs["cpu"][2]), name
