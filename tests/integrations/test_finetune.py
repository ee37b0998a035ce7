"""Fine-tuning as users do it: LoRA through peft, frozen and integer parameters, Hugging Face
``from_pretrained`` and meta-device construction under ``zeroplug.init``, state dicts under
stage 3, and the loops users write (``model.zero_grad()``, accumulation with ``step()`` at the
boundary only, torch-style parameter groups, keyword inputs).

Reference: plain torch (single process, torch.optim.AdamW over the trainable parameters,
one global batch per step). fp32 losses within 1e-5 relative; frozen weights bit-identical.
"""
from __future__ import annotations

import pytest
import torch

from tests.support import real_models as R
from tests.support.distributed import run_ranks
from tests.support.toy import peak_bytes

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA_STEPS = 10
LOSS_RTOL = 1e-5


def lora(model):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          init_lora_weights="gaussian")
    return peft.get_peft_model(model, cfg)


LORA_CASES = [(stage, off, init) for stage in (0, 1, 2, 3) for off in ("none", "cpu", "nvme")
              for init in (False, True) if stage == 3 or not init]


def _lora_cases(rank, world, tmp):
    out = {}
    for stage, off, init in LORA_CASES:
        cfg = R.config(stage, world, off, nvme_path=tmp)
        out[(stage, off, init)] = R.zeroplug_losses(rank, world, "llama", cfg, LORA_STEPS, prepare=lora,
                                                    use_init=init)
    return out


@pytest.fixture(scope="module")
def lora_reference():
    return R.torch_losses("llama", LORA_STEPS, prepare=lora)


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def lora_results(request, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("nvme"))
    return run_ranks(_lora_cases, request.param, tmp)[0]


@pytest.mark.parametrize("stage,offload,init", LORA_CASES,
                         ids=[f"stage{s}-{o}" + ("-init" if i else "") for s, o, i in LORA_CASES])
def test_lora_follows_torch_and_leaves_the_base_alone(lora_results, lora_reference, stage, offload, init):
    losses, sd = lora_results[(stage, offload, init)]
    ref_losses, ref_sd = lora_reference
    assert R.max_rel(losses, ref_losses) <= LOSS_RTOL
    base = [k for k in ref_sd if "lora_" not in k]
    assert base and all(torch.equal(sd[k], ref_sd[k]) for k in base)     # bit-identical
    adapters = [k for k in ref_sd if "lora_" in k]
    assert adapters and R.max_abs({k: sd[k] for k in adapters}, {k: ref_sd[k] for k in adapters}) < 1e-3


# -- optimizer memory covers the adapters only ------------------------------------------------
def _optimizer_bytes(rank, world):
    import zeroplug
    from zeroplug.flat import storage_bytes
    out = []
    for stage in (2, 3):
        cfg = R.config(stage, world, precision="bf16")
        model = lora(R.build("llama"))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        engine = zeroplug.initialize(model, cfg)
        engine.backward(engine(**R.batch("llama", 0, 0, R.GLOBAL_BATCH // world)).loss)
        engine.step()
        masters = engine.partitioner.master_params()
        states = [v for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
        shard = sum(u.hi - u.lo for u in engine.partitioner.units)
        out.append((stage, trainable, shard, storage_bytes(masters) + storage_bytes(states),
                    len(engine.partitioner.units)))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_optimizer_states_are_12_bytes_per_trainable_element(world):
    for rank_out in run_ranks(_optimizer_bytes, world):
        for stage, trainable, shard, nbytes, units in rank_out:
            # fp32 master + Adam's two fp32 moments: 12 bytes per element of this rank's shard
            assert nbytes == 12 * shard, (stage, nbytes, shard)
            # ... and the shard is this rank's share of the trainable elements (plus padding
            # of each unit to a multiple of the world size), not of the whole model
            assert trainable / world <= shard <= trainable / world + units * world
    if world == 1:
        assert shard == trainable


# -- frozen and integer parameters -------------------------------------------------------------
class WithFrozenAndInt(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.b.weight.requires_grad_(False)            # frozen weight beside a trainable bias
        self.steps = torch.nn.Parameter(torch.arange(5, dtype=torch.int64), requires_grad=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).pow(2).mean()


def _frozen_cases(rank, world, tmp):
    import zeroplug
    out = {}
    for stage in (0, 1, 2, 3):
        for off in ("none", "cpu", "nvme"):
            torch.manual_seed(0)
            model = WithFrozenAndInt()
            frozen = model.b.weight.detach().clone()
            cfg = R.config(stage, world, off, nvme_path=tmp)
            cfg["batch"]["micro_batch_size"] = 2
            engine = zeroplug.initialize(model, cfg)
            for s in range(3):
                engine.backward(engine(torch.randn(2, 8, generator=torch.Generator().manual_seed(s))))
                engine.step()
            with engine.gathered_parameters():
                out[(stage, off)] = (torch.equal(model.b.weight.detach().cpu(), frozen),
                                     model.steps.dtype, model.steps.tolist(),
                                     sum(t.numel() for t in engine.partitioner.master_params()))
            engine.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_frozen_and_integer_parameters_are_never_touched(world, tmp_path):
    res = run_ranks(_frozen_cases, world, str(tmp_path))[0]
    trainable = 8 * 8 + 8 + 8
    for (stage, off), (unchanged, dtype, values, master_elems) in res.items():
        assert unchanged, (stage, off)
        assert dtype == torch.int64 and values == [0, 1, 2, 3, 4], (stage, off)
        assert master_elems <= trainable + 2 * world, (stage, off, master_elems)


def test_unfreezing_after_initialize_is_refused():
    import zeroplug
    from zeroplug.errors import StateError
    for stage in (0, 3):
        model = WithFrozenAndInt()
        engine = zeroplug.initialize(model, R.config(stage, 1))
        model.b.weight.requires_grad_(True)
        with pytest.raises(StateError, match="b.weight"):
            engine.backward(engine(torch.randn(4, 8)))


# -- zeroplug.init with Hugging Face from_pretrained, and meta + to_empty -----------------------
def _from_pretrained(rank, world, path):
    import transformers as T

    import zeroplug
    cfg = R.config(3, world, stage3_param_persistence_threshold=0)
    ids = R.batch("llama", 0)["input_ids"]

    def load():
        with zeroplug.init(cfg):
            return T.LlamaForCausalLM.from_pretrained(path)

    model, peak = peak_bytes(load)
    engine = zeroplug.initialize(model, cfg)
    shard_bytes = sum((u.hi - u.lo) * 4 for u in engine.partitioner.all_units)
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    return logits, peak, shard_bytes


def test_from_pretrained_under_init_is_sharded_and_exact(tmp_path):
    import transformers as T
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    plain = T.LlamaForCausalLM(cfg)
    plain.save_pretrained(tmp_path, max_shard_size="400KB")     # a sharded safetensors checkpoint
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = R.batch("llama", 0)["input_ids"]
    with torch.no_grad():
        want = T.LlamaForCausalLM.from_pretrained(tmp_path)(input_ids=ids).logits
    _, loader_peak = peak_bytes(lambda: T.LlamaForCausalLM.from_pretrained(tmp_path))
    model_bytes = sum(p.numel() * 4 for p in plain.parameters())
    for logits, peak, shard_bytes in run_ranks(_from_pretrained, 2, str(tmp_path)):
        assert (logits - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        assert shard_bytes <= 0.55 * model_bytes          # the model: this rank's half
        # Note: transformers' loader holds every tensor it read until the checkpoint is loaded
        # (a plain from_pretrained peaks there too); beyond that, only this rank's shard
        assert peak <= loader_peak + shard_bytes + 256 * 1024, (peak, loader_peak, shard_bytes)


def _meta_to_empty(rank, world):
    import zeroplug
    cfg = R.config(3, world, stage3_param_persistence_threshold=0)
    with zeroplug.init(cfg):
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for m in model:
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    engine = zeroplug.initialize(model, cfg)
    return engine.consolidated_state_dict()


def test_meta_construction_then_to_empty_and_init_equals_a_plain_build():
    with torch.device("meta"):
        plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    plain.to_empty(device="cpu")
    torch.manual_seed(0)
    for m in plain:
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    sd = run_ranks(_meta_to_empty, 2)[0]
    for k, v in plain.state_dict().items():
        assert torch.equal(sd[k], v), k


# -- state dicts under stage 3 ----------------------------------------------------------------
def _state_dicts(rank, world, out_dir):
    import zeroplug
    from zeroplug.errors import StateError
    cfg = R.config(3, world)
    model = R.build("llama")
    engine = zeroplug.initialize(model, cfg)
    engine.backward(engine(**R.batch("llama", 0, rank * 2, rank * 2 + 2)).loss)
    engine.step()
    try:
        model.state_dict()
        refused = None
    except StateError as e:
        refused = str(e)
    with engine.gathered_parameters():
        inside = {k: v.clone() for k, v in model.state_dict().items()}
    engine.save_pretrained(out_dir)
    return refused, inside, engine.consolidated_state_dict()


def test_stage3_state_dict_is_refused_clearly_and_save_pretrained_round_trips(tmp_path):
    import transformers as T
    res = run_ranks(_state_dicts, 2, str(tmp_path))
    refused, inside, whole = res[0]
    assert refused and "engine.consolidated_state_dict()" in refused and "save_pretrained" in refused
    assert set(inside) == set(whole) and all(torch.equal(inside[k], whole[k]) for k in whole)
    loaded = T.LlamaForCausalLM.from_pretrained(tmp_path)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, whole[k]), k


# -- the loops users write ----------------------------------------------------------------------
def _loops(rank, world):
    """Each style trains 3 optimizer steps; accumulation styles take 2 micro-batches a step."""
    import zeroplug
    out = {}
    for stage in (0, 1, 2, 3):
        for style in ("plain", "zero_grad", "zero_grad_keep", "every_micro", "boundary_only"):
            gas = 2 if style in ("every_micro", "boundary_only") else 1
            cfg = R.config(stage, world, gas=gas)
            model = R.build("gpt2")
            engine = zeroplug.initialize(model, cfg)
            m = cfg["batch"]["micro_batch_size"]
            for s in range(3):
                for k in range(gas):
                    lo = (k * world + rank) * m
                    engine.backward(engine(**R.batch("gpt2", s, lo, lo + m)).loss)
                    if style != "boundary_only":
                        engine.step()       # DeepSpeed's loop: step() after every micro-batch
                if style == "boundary_only":
                    engine.step()           # the plain PyTorch loop: step() once per window
                if style == "zero_grad":
                    model.zero_grad()
                elif style == "zero_grad_keep":
                    model.zero_grad(set_to_none=False)
            out[(stage, style)] = (engine.global_step, engine.consolidated_state_dict())
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_zero_grad_and_boundary_only_step_change_nothing(world):
    res = run_ranks(_loops, world)[0]
    for stage in (0, 1, 2, 3):
        for style, ref_style in (("zero_grad", "plain"), ("zero_grad_keep", "plain"),
                                 ("boundary_only", "every_micro")):
            steps, sd = res[(stage, style)]
            _, ref = res[(stage, ref_style)]
            assert steps == 3, (stage, style)        # one optimizer step per window
            assert all(torch.equal(sd[k], ref[k]) for k in ref), (stage, style)


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1, "lr": 2e-2},
            {"params": no_decay, "weight_decay": 0.0, "betas": (0.8, 0.99)}]


def _grouped(rank, world):
    out = {}
    for stage in (0, 1, 2, 3):
        for off in ("none", "cpu"):
            out[(stage, off)] = R.zeroplug_losses(rank, world, "gpt2", R.config(stage, world, off), 5,
                                                  groups=_groups)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_parameter_groups_follow_torch_adamw_with_the_same_groups(world):
    ref_losses, ref_sd = R.torch_losses("gpt2", 5, groups=_groups)
    plain_losses, _ = R.torch_losses("gpt2", 5)
    assert R.max_rel(plain_losses, ref_losses) > 1e-4        # the groups do change training
    for (stage, off), (losses, sd) in run_ranks(_grouped, world)[0].items():
        assert R.max_rel(losses, ref_losses) <= LOSS_RTOL, (stage, off)
        assert R.max_abs(sd, ref_sd) <= 5e-3, (stage, off)     # lr 2e-2 here: Adam moves near-zero-gradient weights by up to lr


def test_model_parameters_must_cover_every_trainable_parameter():
    import zeroplug
    from zeroplug.errors import ConfigError
    model = R.build("gpt2")
    with pytest.raises(ConfigError, match="requires grad but is in no group"):
        zeroplug.initialize(model, R.config(0, 1), model_parameters=[model.lm_head.weight])


def test_tokens_are_counted_from_keyword_input_ids():
    import zeroplug
    cfg = R.config(0, 1)
    cfg["batch"]["steps_per_print"] = 1
    engine = zeroplug.initialize(R.build("gpt2"), cfg)
    b = R.batch("gpt2", 0)
    for _ in range(2):          # the first step measured has no rate
        engine.backward(engine(input_ids=b["input_ids"], labels=b["labels"]).loss)
        engine.step()
    assert engine.tokens_per_sample == R.SEQ
    assert engine.last_metrics["tokens_per_sec"] > 0


def test_tokens_are_counted_from_a_batch_passed_whole():
    """Lightning calls the model with the whole batch: (x, y) or a dict; 2-D inputs only."""
    from zeroplug.observe.metrics import sequence_length
    x = torch.zeros(4, 17, dtype=torch.long)
    assert sequence_length((x, x)) == sequence_length([x]) == sequence_length({"input_ids": x}) == 17
    assert sequence_length({"pixel_values": x}) == 17 and sequence_length(x) == 17
    assert sequence_length(torch.zeros(4)) is None and sequence_length(()) is None and sequence_length(None) is None
    # float inputs (feature vectors, images, embeddings) have no sequence dimension to count
    assert sequence_length(torch.zeros(4, 17)) is None and sequence_length({"pixel_values": torch.zeros(4, 3, 8, 8)}) is None


def _external_read_after_init(rank, world):
    import zeroplug
    cfg = R.config(3, world, stage3_param_persistence_threshold=0)
    with zeroplug.init(cfg):
        model = R.build("moe")          # its loss reads head.weight outside head's forward
    engine = zeroplug.initialize(model, cfg)
    m = R.GLOBAL_BATCH // world
    losses = []
    for s in range(3):
        loss = engine(**R.batch("moe", s, rank * m, (rank + 1) * m)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_a_weight_read_outside_its_module_works_for_a_model_built_under_init():
    res = run_ranks(_external_read_after_init, 2)
    ref, _ = R.torch_losses("moe", 3)
    mean = [(a + b) / 2 for a, b in zip(res[0], res[1])]
    assert R.max_rel(mean, ref) <= LOSS_RTOL


def _grouped_resume(rank, world, ck):
    import zeroplug
    cfg = R.config(2, world, "cpu")
    m = R.GLOBAL_BATCH // world

    def steps(engine, a, b):
        for s in range(a, b):
            engine.backward(engine(**R.batch("gpt2", s, rank * m, (rank + 1) * m)).loss)
            engine.step()

    model = R.build("gpt2")
    whole = zeroplug.initialize(model, cfg, model_parameters=_groups(model))
    steps(whole, 0, 4)
    want = whole.consolidated_state_dict()
    whole.close()
    model = R.build("gpt2")
    first = zeroplug.initialize(model, cfg, model_parameters=_groups(model))
    steps(first, 0, 2)
    first.save_checkpoint(ck)
    first.close()
    model = R.build("gpt2")
    second = zeroplug.initialize(model, cfg, model_parameters=_groups(model))
    second.load_checkpoint(ck)
    steps(second, 2, 4)
    got = second.consolidated_state_dict()
    second.close()
    return want, got


def test_resume_with_parameter_groups_is_exact(tmp_path):
    want, got = run_ranks(_grouped_resume, 1, str(tmp_path / "ck"))[0]
    assert all(torch.equal(want[k], got[k]) for k in want)
