"""Activation offload ([activation_checkpointing] plugin = "cpu"): the checkpointed blocks'
inputs wait in host memory for their recompute. Exactness: losses, gradients and parameters
bit-identical to keeping them on the device, for the reference GPT and Hugging Face models
(reentrant and non-reentrant checkpointing, nested checkpoints). On the CPU the "host" copy is
a real copy into new memory (pin_memory off), the original released; the GPU tests at the end
measure that the device memory goes."""
from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import zeroplug
from zeroplug.plugins.workload.models import GPT, GPTConfig
from zeroplug.plugins.activations.saved import HostActivations

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=3, d_model=32, n_head=4, activation_checkpointing=True)


def _config(plugin, **extra):
    table = {"plugin": plugin, **({"min_offload_bytes": 0} if plugin == "cpu" else {}), **extra}
    return {"batch": {"micro_batch_size": 2}, "optimizer": {"plugin": "adamw", "lr": 1e-2},
            "monitor": {"plugin": "none"}, "activation_checkpointing": table}


def _gpt_run(plugin, steps=3, device="cpu", cfg=CFG, zero="stage0", **extra):
    torch.manual_seed(0)
    model = GPT(cfg)
    engine = zeroplug.initialize(model, {**_config(plugin, **extra), "zero": {"plugin": zero}}, device=device)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g).to(device)
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with engine.gathered_parameters():       # stage 3: whole values
        params = [p.detach().cpu().clone() for p in model.parameters()]
    stats = dict(getattr(engine.activations, "stats", {}))
    engine.close()
    return losses, params, stats


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("stage", ["stage0", "stage3"])
def test_gpt_training_is_bit_identical_and_block_inputs_go_through_the_host(stage):
    ref_losses, ref_params, _ = _gpt_run("none", zero=stage)
    losses, params, stats = _gpt_run("cpu", zero=stage)
    assert losses == ref_losses
    assert _same(params, ref_params)
    # exactly the checkpointed blocks' inputs, one per block per step (not the embeddings'
    # or the head's saved tensors), and every one came back through a copy
    assert stats["offloaded"] == CFG.n_layer * 3
    assert stats["offloaded_bytes"] == CFG.n_layer * 3 * 2 * CFG.seq_len * CFG.d_model * 4
    assert stats["fetched"] + stats["prefetched"] + stats["kept"] == stats["offloaded"]
    assert stats["prefetched"] > 0


def test_small_block_inputs_stay_on_the_device():
    _, _, stats = _gpt_run("cpu", steps=1, min_offload_bytes=2 * CFG.seq_len * CFG.d_model * 4 + 1)
    assert stats.get("offloaded", 0) == 0


def _block_outputs_alive(plugin):
    """How many blocks' outputs (the next block's inputs) are still alive after the forward."""
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = zeroplug.initialize(model, _config(plugin), device="cpu")
    refs = []
    hooks = [b.register_forward_hook(lambda m, i, o: refs.append(weakref.ref(o))) for b in model.blocks]
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1))
    loss = engine(x[:, :-1], x[:, 1:])
    gc.collect()
    alive = sum(r() is not None for r in refs[:-1])      # the last block's output feeds ln_f
    engine.backward(loss)
    engine.step()
    for h in hooks:
        h.remove()
    engine.close()
    return alive


def test_saved_block_inputs_leave_their_memory():
    assert _block_outputs_alive("none") == CFG.n_layer - 1      # the graph holds each
    assert _block_outputs_alive("cpu") == 0                      # only their host copies remain


# --- Hugging Face models with gradient checkpointing ---------------------------------------------

def _hf_run(plugin, reentrant, steps=2):
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = T.LlamaForCausalLM(cfg)
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):      # transformers >= 5.2x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    engine = zeroplug.initialize(model, _config(plugin), device="cpu")
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = [p.detach().clone() for p in model.parameters()]
    stats = dict(getattr(engine.activations, "stats", {}))
    engine.close()
    return losses, params, stats


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_hf_model_with_gradient_checkpointing_is_bit_identical(reentrant):
    ref_losses, ref_params, _ = _hf_run("none", reentrant)
    losses, params, stats = _hf_run("cpu", reentrant)
    assert losses == ref_losses
    assert _same(params, ref_params)
    assert stats["offloaded"] == 3 * 2          # each decoder layer's hidden states, each step
    assert stats["fetched"] + stats["prefetched"] + stats["kept"] == stats["offloaded"]


# --- the hooks on their own: checkpoint variants, nesting, graphs kept ---------------------------

class Stack(torch.nn.Module):
    """Blocks checkpointed as asked: ``mode`` "plain" | "reentrant" | "nested" (a non-reentrant
    checkpoint of pairs of blocks, each itself checkpointed) | "reentrant_outer" (reentrant around
    non-reentrant ones)."""

    def __init__(self, mode, depth=4, width=16):
        super().__init__()
        self.mode = mode
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def pair(self, x, i):
        inner = self.mode == "nested" or self.mode == "reentrant_outer"
        for b in self.blocks[i:i + 2]:
            x = checkpoint(b, x, use_reentrant=False) if inner else b(x)
        return x

    def forward(self, x):
        if self.mode in ("plain", "reentrant"):
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=self.mode == "reentrant")
        else:
            for i in range(0, len(self.blocks), 2):
                x = checkpoint(self.pair, x, i, use_reentrant=self.mode == "reentrant_outer")
        return self.head(x).square().mean()


def _grads(mode, store=None, backwards=1):
    torch.manual_seed(0)
    model = Stack(mode)
    x = torch.randn(8, 16, requires_grad=mode.startswith("reentrant"))
    if store is None:
        loss = model(x)
    else:
        with store.hooks():
            loss = model(x)
    for i in range(backwards):
        loss.backward(retain_graph=i + 1 < backwards)
    return [p.grad.clone() for p in model.parameters()], loss.item()


@pytest.mark.parametrize("mode", ["plain", "reentrant", "nested", "reentrant_outer"])
def test_checkpoint_variants_give_the_same_gradients(mode):
    ref = _grads(mode)
    store = HostActivations(torch.device("cpu"), pin_memory=False, buffer_count=2, min_bytes=0)
    got = _grads(mode, store)
    assert got[1] == ref[1] and _same(got[0], ref[0])
    outer = 4 if mode in ("plain", "reentrant") else 2      # the outermost checkpoints' inputs only
    assert store.stats["offloaded"] == outer - mode.startswith("reentrant")   # x, a leaf, stays: the user holds it


def test_a_graph_used_twice_fetches_again():
    ref = _grads("plain", backwards=2)
    store = HostActivations(torch.device("cpu"), pin_memory=False, buffer_count=1, min_bytes=0)
    got = _grads("plain", store, backwards=2)
    assert _same(got[0], ref[0])
    s = store.stats
    assert s["fetched"] + s["prefetched"] + s["kept"] == 2 * s["offloaded"]


def test_two_forwards_before_one_backward():
    torch.manual_seed(0)
    model = Stack("plain")
    xs = [torch.randn(8, 16) for _ in range(2)]
    sum(model(x) for x in xs).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    store = HostActivations(torch.device("cpu"), pin_memory=False, buffer_count=2, min_bytes=0)
    losses = []
    for x in xs:
        with store.hooks():
            losses.append(model(x))
    sum(losses).backward()
    assert _same([p.grad for p in model.parameters()], ref)
    assert store.stats["offloaded"] == 2 * 4


def test_a_dropped_graph_frees_its_host_copies():
    store = HostActivations(torch.device("cpu"), pin_memory=False, buffer_count=2, min_bytes=0)
    model = Stack("plain")
    with store.hooks():
        loss = model(torch.randn(8, 16))
    assert store.stats["offloaded"] == 4 and store.host_bytes() == 4 * 8 * 16 * 4
    del loss
    assert store.host_bytes() == 0        # no cycle keeps them: freed at once, gc or not


def test_without_checkpointing_nothing_moves_and_it_says_so(caplog):
    cfg = CFG.with_(activation_checkpointing=False)
    with caplog.at_level(logging.WARNING, logger="zeroplug"):
        ref = _gpt_run("none", steps=1, cfg=cfg)
        got = _gpt_run("cpu", steps=1, cfg=cfg)
    assert got[0] == ref[0] and got[2].get("offloaded", 0) == 0
    assert sum("turn activation checkpointing on" in r.getMessage() for r in caplog.records) == 1


def test_unknown_option_is_refused():
    from zeroplug.errors import ConfigError
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        zeroplug.load_config({"activation_checkpointing": {"plugin": "cpu", "buffers": 2}})


# --- GPU ------------------------------------------------------------------------------------------

GPU_CFG = GPTConfig(vocab_size=512, seq_len=256, n_layer=6, d_model=512, n_head=8, activation_checkpointing=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bit_identical():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):       # attention kernels whose backward has no atomics
        ref = _gpt_run("none", device="cuda", cfg=GPU_CFG)
        again = _gpt_run("none", device="cuda", cfg=GPU_CFG)
        got = _gpt_run("cpu", device="cuda", cfg=GPU_CFG)
    assert again[0] == ref[0] and _same(again[1], ref[1]), "the run itself is not deterministic here"
    assert got[0] == ref[0] and _same(got[1], ref[1])
    assert got[2]["offloaded"] == GPU_CFG.n_layer * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("buffer_count", [1, 2])
def test_gpu_forward_holds_less_by_the_block_inputs(buffer_count):
    """After the forward, the device holds fewer bytes by about the offloaded block inputs
    (all but the ones whose copies are still in flight: at most ``buffer_count``)."""
    batch, dev = 4, torch.device("cuda")

    def after_forward(plugin):
        torch.manual_seed(0)
        model = GPT(GPU_CFG)
        extra = {"buffer_count": buffer_count} if plugin == "cpu" else {}
        engine = zeroplug.initialize(model, _config(plugin, **extra), device=dev)
        x = torch.randint(0, GPU_CFG.vocab_size, (batch, GPU_CFG.seq_len + 1), device=dev)
        for _ in range(2):        # the second step: the allocator and the pinned buffers warm
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            loss = engine(x[:, :-1], x[:, 1:])
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - base
            engine.backward(loss)
            engine.step()
        stats = dict(getattr(engine.activations, "stats", {}))
        engine.close()
        return held, stats

    on_device, _ = after_forward("none")
    on_host, stats = after_forward("cpu")
    block_input = batch * GPU_CFG.seq_len * GPU_CFG.d_model * 4
    saved = on_device - on_host
    # every block's input but the last feeds ln_f too; the ones still in flight may stay
    assert (GPU_CFG.n_layer - 1 - buffer_count) * block_input <= saved <= GPU_CFG.n_layer * block_input
    assert stats["offloaded"] == 2 * GPU_CFG.n_layer


# --- DeepSpeed's activation_checkpointing section -------------------------------------------------

@pytest.mark.parametrize("value, plugin", [(True, "cpu"), (False, "none"), ("true", "cpu")])
def test_deepspeed_cpu_checkpointing_picks_the_store(value, plugin):
    cfg = zeroplug.load_config({"train_batch_size": 2, "activation_checkpointing": {
        "partition_activations": False, "cpu_checkpointing": value, "contiguous_memory_optimization": False,
        "number_checkpoints": 4, "synchronize_checkpoint_boundary": False, "profile": False}})
    assert cfg.slot("activation_checkpointing").name == plugin


def test_deepspeed_cpu_checkpointing_must_be_a_boolean():
    from zeroplug.errors import ConfigError
    with pytest.raises(ConfigError, match="activation_checkpointing.cpu_checkpointing = 2: use true or false"):
        zeroplug.load_config({"train_batch_size": 2, "activation_checkpointing": {"cpu_checkpointing": 2}})


# --- zeroplug estimate and tune ----------------------------------------------------------------

def test_estimate_moves_the_checkpointed_inputs_to_the_host_column(capsys):
    from zeroplug.cli import main
    args = ["estimate", "--model", "char-tiny", "--micro-batch", "128", "--seq", "128", "--device", "cpu"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--activations-on-host"]) == 0
    moved = capsys.readouterr().out

    def row(text):     # stage 3, everything offloaded: (device GiB, host GiB)
        line = next(ln for ln in text.splitlines() if ln.split()[:2] == ["3", "param+optim"])
        return float(line.split()[2]), float(line.split()[3])
    inputs = 4 * 128 * 128 * 128 * 4 / 2 ** 30         # 4 blocks' fp32 inputs, micro batch 128 x 128
    assert f"the checkpointed blocks' inputs {inputs:.3f} GiB" in plain
    (d0, h0), (d1, h1) = row(plain), row(moved)
    assert h1 - h0 == pytest.approx(inputs, abs=0.011)          # (the columns are rounded to 0.01)
    assert d0 - d1 == pytest.approx(inputs / 2, abs=0.011)      # buffer_count (2) of 4 stay in flight
    assert main(["estimate", "--params", "1e9", "--activations-on-host"]) == 2
    assert "--activations-on-host needs --micro-batch" in capsys.readouterr().err


def test_tune_proposes_activations_on_the_host_only_when_the_gpu_is_short():
    from zeroplug.tools.probe import Activations
    from zeroplug.tools.tune import Candidate, Machine, config_for, estimate, reject_reason, with_activations_on_host
    GiB = 2 ** 30
    acts = Activations(total=20 * GiB, fixed=4 * GiB, per_layer=0.5 * GiB, checkpointed=8 * GiB, layers=32)

    def machine(free):
        return Machine(torch.device("cuda"), "H100", free * GiB, 500 * GiB, None, 0.0)
    n = 1_000_000_000
    for free, expect in ((60.0, False), (20.0, True)):
        m = machine(free)
        c = Candidate(1, 2, "cpu")
        estimate(c, n, acts, m)
        v = with_activations_on_host(c, n, acts, m)
        assert (v is not None) == expect
    assert reject_reason(c, m) is not None and reject_reason(v, m) is None
    assert c.est_device - v.est_device == pytest.approx(8 * GiB - 2 * 0.25 * GiB)
    assert v.est_host - c.est_host == pytest.approx(8 * GiB)
    assert v.name == "stage2 + optimizer on CPU + activations on CPU"
    cfg = config_for(v, 8, m, 1e-4, False)
    assert cfg["activation_checkpointing"] == {"plugin": "cpu"}
    assert zeroplug.load_config(cfg).slot("activation_checkpointing").name == "cpu"
    no_ckpt = Activations(total=20 * GiB, layers=32)          # nothing checkpointed: nothing to move
    assert with_activations_on_host(c, n, no_ckpt, m) is None


def test_zeroplug_train_checkpoints_its_blocks_when_a_store_is_chosen(capsys, caplog):
    from zeroplug.cli import main
    args = ["train", "--steps", "2", "--seq", "32", "--monitor.plugin=none", "--batch.micro_batch_size=2"]
    with caplog.at_level(logging.WARNING, logger="zeroplug"):
        assert main([*args, "--activation_checkpointing.plugin=cpu", "--activation_checkpointing.min_offload_bytes=0"]) == 0
    assert not any("turn activation checkpointing on" in r.getMessage() for r in caplog.records)
    with_host = capsys.readouterr().out
    assert main([*args, "--activation-checkpointing"]) == 0
    on_device = capsys.readouterr().out

    def losses(text):      # the train and held-out loss lines: the same values either way
        return [ln for ln in text.splitlines() if ln.startswith(("train loss", "held-out loss"))]
    assert losses(with_host) and losses(with_host) == losses(on_device)


def test_the_trainer_with_gradient_checkpointing(tmp_path):
    """TrainingArguments(gradient_checkpointing=True): the Trainer's losses are the same with the
    blocks' inputs on the host (zeroplug's table) as on the device (a DeepSpeed JSON's
    cpu_checkpointing false)."""
    T = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from zeroplug.integrations.transformers import ZeroplugTrainer

    class Tokens(torch.utils.data.Dataset):
        x = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(3))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    def run(cpu):
        torch.manual_seed(0)
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2, max_position_embeddings=64))
        args = T.TrainingArguments(output_dir=str(tmp_path / str(cpu)), per_device_train_batch_size=2, max_steps=3,
                                   learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                                   disable_tqdm=True, use_cpu=True, seed=0, gradient_checkpointing=True,
                                   gradient_checkpointing_kwargs={"use_reentrant": False})
        config = ({"zero": {"plugin": "stage2"}, "activation_checkpointing": {"plugin": "cpu", "min_offload_bytes": 0}}
                  if cpu else
                  {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                   "zero_optimization": {"stage": 2},
                   "activation_checkpointing": {"cpu_checkpointing": False, "partition_activations": False}})
        trainer = ZeroplugTrainer(model=model, args=args, train_dataset=Tokens(), zeroplug_config=config)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, dict(getattr(trainer.engine.activations, "stats", {}))

    ref, _ = run(False)
    got, stats = run(True)
    assert len(ref) == 3 and got == ref
    assert stats["offloaded"] == 2 * 3 and stats["offloaded_bytes"] == 2 * 3 * 2 * 12 * 32 * 4
