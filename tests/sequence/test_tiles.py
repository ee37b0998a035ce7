"""Tiles along the sequence on one process, and the one-line errors of impossible combinations.

The tiled MLP and the tiled head loss against the same computation untiled (fp32: rounding only,
1e-6 relative on values and gradients); whole models (the reference GPT, a Hugging Face Llama)
trained with tiles against plain torch; activation checkpoints in host memory counted against
the host's memory.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zeroplug
from zeroplug.errors import ConfigError, HostMemoryError

from .cases import build, config, max_abs, max_rel, reference, train

RTOL = 1e-6


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= RTOL * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("chunks", [1, 3, 7])
def test_tiled_head_loss_matches_cross_entropy(chunks):
    from zeroplug.plugins.sequence.tiles import head_loss_sum
    torch.manual_seed(0)
    h = torch.randn(20, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    b = torch.randn(50, requires_grad=True)
    t = torch.randint(0, 50, (20,))
    t[[2, 5, 11]] = -100
    want = F.cross_entropy(F.linear(h, w, b), t, reduction="sum")
    gh, gw, gb = torch.autograd.grad(want * 0.5, (h, w, b))
    got = head_loss_sum(h, w, b, t, -100, chunks)
    th, tw, tb = torch.autograd.grad(got * 0.5, (h, w, b))
    assert _close(got, want) and _close(th, gh) and _close(tw, gw) and _close(tb, gb)


@pytest.mark.parametrize("chunks", [2, 5, 40])      # 40 > tokens: empty chunks
def test_tiled_mlp_matches_whole(chunks):
    from zeroplug.plugins.sequence.tiles import tiled_call
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(2, 13, 8, requires_grad=True)
    g = torch.randn(2, 13, 8)
    want = mlp(x)
    ref = torch.autograd.grad(want, [x, *mlp.parameters()], g)
    got = tiled_call(mlp, x, list(mlp.parameters()), chunks)
    grads = torch.autograd.grad(got, [x, *mlp.parameters()], g)
    assert _close(got, want)
    assert all(_close(a, b) for a, b in zip(grads, ref))


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("stage", [0, 3])
def test_tiles_train_like_torch(kind, stage):
    """sequence_parallel_size = 1: the MLP and the loss in tiles (chunks of 4 and 5 tokens),
    checkpointed blocks' inputs in host memory, against plain torch."""
    ref_losses, ref_state = reference(kind, 1)
    got = train(0, 1, kind, config(stage=stage, degree=1, tiled=True, host=True), checkpointing=True)
    assert max_rel(got["losses"], ref_losses) <= 1e-5
    assert max_abs(got["state"], ref_state) <= 1e-5
    assert got["offloaded"] > 0


def test_tiles_are_used():
    """The tiled paths run (not the plain one): the MLP's chunks each call the module."""
    model = build("gpt")
    calls = []
    model.blocks[0].mlp.fc.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[1]))
    engine = zeroplug.initialize(model, config(stage=0, degree=1, tiled=True), device="cpu")
    x = torch.randint(0, 64, (1, 20))
    engine.backward(engine(x, x))
    engine.close()
    assert calls[:5] == [4, 4, 4, 4, 4] and len(calls) == 10      # forward, then the backward's recompute


def test_host_checkpoints_counted_against_host_memory(monkeypatch):
    """A host share too small for the checkpointed inputs: refused with the numbers, before the copy."""
    monkeypatch.setenv("ZEROPLUG_HOST_MEMORY_LIMIT", "4KiB")
    model = build("gpt", checkpointing=True)
    cfg = config(stage=0, degree=1, tiled=True, host=True)
    engine = zeroplug.initialize(model, cfg, device="cpu")
    x = torch.randint(0, 64, (1, 29))
    with pytest.raises(HostMemoryError, match="activation_checkpointing.*ZEROPLUG_HOST_MEMORY_LIMIT") as info:
        engine(x, x)
    assert "\n" not in str(info.value)
    engine.close()


@pytest.mark.parametrize("cfg, world, match", [
    ({"sequence": {"plugin": "ulysses", "sequence_parallel_size": 3}}, 4,
     r"sequence.sequence_parallel_size = 3 does not divide the world size \(4\)"),
    ({"sequence": {"plugin": "ulysses", "tiled_mlp": False, "tiled_loss": False}}, 1, "does nothing"),
    ({"sequence": {"plugin": "ulysses", "sequence_parallel_size": 2},
      "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "train_batch_size": 4}}, 4,
     r"data-parallel ranks \(2 = world size 4 / sequence_parallel_size 2\)"),
    ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
      "sequence_parallel_size": 2}, 4, r"data-parallel ranks \(2 = world size / sequence_parallel_size 2\)"),
    ({"sequence_parallel_size": 0}, 1, "sequence_parallel_size = 0: use a positive integer"),
])
def test_config_errors(cfg, world, match):
    with pytest.raises(ConfigError, match=match) as info:
        zeroplug.config.load(cfg, world_size=world)
    assert "\n" not in str(info.value)


def test_shard_batch_refuses_left_padding():
    from zeroplug.plugins.sequence import shard_batch
    ids = torch.randint(0, 64, (1, 8))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="not right padding"):
        shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask}, 0, 2)


def test_shard_batch_slices():
    """Padding to a multiple of the degree, labels shifted before the cut, positions continued."""
    from zeroplug.plugins.sequence import shard_batch
    ids = torch.arange(1, 8).unsqueeze(0)                # 7 tokens, 2 ranks: padded to 8
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    got = [shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask}, r, 2) for r in (0, 1)]
    assert got[0]["input_ids"].tolist() == [[1, 2, 3, 4]] and got[1]["input_ids"].tolist() == [[5, 6, 7, 0]]
    assert got[0]["shift_labels"].tolist() == [[2, 3, 4, 5]]
    assert got[1]["shift_labels"].tolist() == [[6, -100, -100, -100]]     # 7 is padding; the rest past the end
    assert got[1]["position_ids"].tolist() == [[4, 5, 6, 7]]
    assert "attention_mask" not in got[0] and "labels" not in got[0]


def test_train_command_at_a_longer_sequence(capsys, tmp_path, monkeypatch):
    """`zeroplug train --seq N` past the preset's positions, with tiles and host checkpoints."""
    from zeroplug.cli import main
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--steps", "2", "--seq", "192", "--max-bytes", "60000", "--batch.micro_batch_size=1",
                 "--sequence.plugin=ulysses", "--sequence.mlp_chunk_tokens=64", "--sequence.loss_chunk_tokens=50",
                 "--activation_checkpointing.plugin=cpu", "--activation_checkpointing.min_offload_bytes=0",
                 "--monitor.plugin=none"])
    out = capsys.readouterr().out
    assert code == 0 and "train loss: first step" in out


@pytest.mark.parametrize("seq, device_gib, needs", [
    (8192, 80, ["needs: nothing"]),
    (262144, 80, ["needs: the MLP and the loss in tiles", "\"ulysses\")\n"]),
    (524288, 60, ["needs: the MLP and the loss in tiles", "checkpointed inputs in host memory"]),
    (4_000_000, 80, ["sequence parallelism over 8 ranks"]),
])
def test_estimate_seq(capsys, seq, device_gib, needs):
    from zeroplug.cli import main
    assert main(["estimate", "--model", "1.3B", "--seq", str(seq), "--device-gib", str(device_gib),
                 "--host-gib", "120"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in needs) and "checkpointed blocks' inputs" in out
    if seq == 524288:       # 24 layers x 524,288 x 2,048 x 2 bytes
        assert "48.00 GiB" in out


def test_host_checkpoints_keep_the_first_on_the_device():
    """device_bytes: the first block inputs of a forward, up to that many bytes, stay on the device;
    the losses and parameters are those of keeping none there."""
    ref_losses, ref_state = reference("gpt", 1)
    one = 1 * 29 * 32 * 4                        # a block input: micro batch x tokens x d_model x fp32
    cfg = config(stage=0, degree=1, tiled=True, host=True)
    cfg["activation_checkpointing"]["device_bytes"] = one
    import zeroplug
    from zeroplug.plugins.sequence import for_engine
    from .cases import samples
    engine = zeroplug.initialize(build("gpt", checkpointing=True), cfg, device="cpu")
    losses = []
    for _ in range(2):
        loss = engine(**for_engine(engine).shard(samples("gpt", 1)[0]))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    stats = dict(engine.activations.stats)
    state = engine.consolidated_state_dict()
    engine.close()
    assert stats["kept_on_device"] == 2 and stats["offloaded"] == 2      # 2 blocks per forward, 2 steps
    assert max_rel(losses, ref_losses) <= 1e-5 and max_abs(state, ref_state) <= 1e-5
