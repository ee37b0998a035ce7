"""Stage 3 gathers each repeated block (a transformer layer) as one unit
(``zero.stage3_block_units``, on by default): which modules are blocks, one all-gather and
one reduce-scatter per block and step instead of one per module, and training that follows
torch AdamW exactly on 2 real ranks (gloo), with activation checkpointing of either kind.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zeroplug
from tests.support.distributed import run_ranks
from zeroplug.plugins.zero.leaves import find_blocks

WORLD, STEPS = 2, 3
VOCAB, D, LAYERS = 40, 16, 3
PER_RANK, SEQ = 2, 5
LR, WD = 1e-2, 0.01


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.up = torch.nn.Linear(D, 4 * D)
        self.down = torch.nn.Linear(4 * D, D)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(self.norm(h))))


class Net(torch.nn.Module):
    def __init__(self, ckpt=None):
        super().__init__()
        self.ckpt = ckpt        # None, "non-reentrant" or "reentrant" activation checkpointing
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, x, y):
        h = self.emb(x)
        for layer in self.layers:
            if self.ckpt is None:
                h = layer(h)
            else:
                h = checkpoint(layer, h, use_reentrant=self.ckpt == "reentrant")
        return F.cross_entropy(self.head(h).view(-1, VOCAB), y.view(-1))


# -- which modules are blocks --------------------------------------------------------
def test_the_layers_of_a_model_are_its_blocks():
    net = Net()
    assert find_blocks(net) == list(net.layers)


def test_nested_blocks_the_innermost():
    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Layer() for _ in range(2))
    stages = torch.nn.ModuleList(Stage() for _ in range(2))
    assert find_blocks(torch.nn.Sequential(stages)) == [b for s in stages for b in s.blocks]


def test_not_blocks():
    # an MLP's Sequential (one-parameter-module entries), mixed classes, a single entry
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    same = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mixed = torch.nn.ModuleList([Layer(), torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Linear(D, D))])
    assert find_blocks(torch.nn.ModuleList([mlp, same, mixed, torch.nn.ModuleList([Layer()])])) == []


def test_a_block_sharing_a_parameter_with_another_module_is_not_one():
    net = Net()
    net.layers[1].up.weight = net.layers[0].up.weight      # tied across two layers
    assert find_blocks(net) == [net.layers[2]]


def test_experts_are_not_blocks_their_layer_is():
    class MoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(D, 2)
            self.experts = torch.nn.ModuleList(Layer() for _ in range(2))
    layers = torch.nn.ModuleList(MoE() for _ in range(2))
    assert find_blocks(torch.nn.Sequential(layers)) == list(layers)
    assert find_blocks(MoE()) == []


def test_hugging_face_decoder_layers():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=64, bos_token_id=0, eos_token_id=1)
    model = transformers.LlamaForCausalLM(cfg)
    assert find_blocks(model) == list(model.model.layers)


# -- training ----------------------------------------------------------------------------
def data():
    g = torch.Generator().manual_seed(3)
    return [[(torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=g), torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=g))
             for _ in range(WORLD)] for _ in range(STEPS)]


def reference(ckpt):
    torch.manual_seed(0)
    model = Net(ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for per in data():
        loss = model(torch.cat([x for x, _ in per]), torch.cat([y for _, y in per]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


CASES = {   # name -> (activation checkpointing, stage3_block_units, stage3_prefetch_bucket_size)
    "blocks": (None, True, "auto"),
    "blocks, checkpointing": ("non-reentrant", True, "auto"),
    "blocks, reentrant checkpointing": ("reentrant", True, "auto"),
    "per module": (None, False, "auto"),
    "blocks, bucket of 1 element": (None, True, 1),
    "blocks, no prefetch": (None, True, 0),
}


def run_case(rank, world, ckpt, blocks, bucket):
    from zeroplug.benchmarking.wire import Collectives
    torch.manual_seed(0)
    model = Net(ckpt)
    engine = zeroplug.initialize(model, {
        "zero": {"plugin": "stage3", "stage3_block_units": blocks, "stage3_param_persistence_threshold": 0,
                 "stage3_prefetch_bucket_size": bucket},
        "precision": {"plugin": "fp32"}, "optimizer": {"plugin": "adamw", "lr": LR, "weight_decay": WD},
        "batch": {"micro_batch_size": PER_RANK, "gradient_clipping": 0.0, "steps_per_print": 10_000},
        "monitor": {"plugin": "none"}})
    part = engine.partitioner
    losses, gathers, reductions = [], [], []
    for i, per in enumerate(data()):
        x, y = per[rank]
        before = part.prefetch_count
        with Collectives() as rec:
            loss = engine(x, y)
            forward_prefetches = part.prefetch_count - before
            engine.backward(loss)
        engine.step()
        ops = [c.op for c in rec.calls]
        gathers.append(sum("allgather" in op for op in ops))
        reductions.append(sum("reduce_scatter" in op for op in ops))
        t = loss.detach().clone()
        engine.run.comm.all_reduce(t)
        losses.append(t.item() / world)
    units = {part.unit_of[p].index for p in model.layers[0].parameters()}
    return {"losses": losses, "state": engine.consolidated_state_dict(), "gathers": gathers[-1],
            "forward_prefetches": forward_prefetches,
            "reductions": reductions[-1], "units_of_layer0": len(units), "units": len(part.units)}


def run_all(rank, world):
    return {name: run_case(rank, world, *case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return run_ranks(run_all, WORLD, timeout=600)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_adamw(case, results):
    ref_losses, ref_state = reference(CASES[case][0])
    res = results[0][case]
    for got, want in zip(res["losses"], ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (case, res["losses"], ref_losses)
    for k, v in ref_state.items():
        torch.testing.assert_close(res["state"][k], v, rtol=0, atol=1e-5, msg=lambda m: f"{case} {k}: {m}")


def test_one_unit_and_fewer_collectives_per_block(results):
    r = results[0]
    assert r["blocks"]["units_of_layer0"] == 1
    assert r["per module"]["units_of_layer0"] == 3          # norm, up, down
    # each layer: one gather (a model this small stays gathered from its forward to its
    # backward: stage3_max_reuse_distance) and one reduction, instead of three of each
    assert r["per module"]["gathers"] - r["blocks"]["gathers"] == LAYERS * (3 - 1)
    assert r["per module"]["reductions"] - r["blocks"]["reductions"] == LAYERS * (3 - 1)
    # checkpointing re-runs each layer's forward inside the backward: gathered again there
    assert r["blocks, checkpointing"]["gathers"] >= r["blocks"]["gathers"]


def test_a_unit_larger_than_the_bucket_is_still_fetched_one_ahead(results):
    """The next unit is fetched ahead whatever the bucket's size (but 0): a bucket of 1
    element is smaller than every unit, yet each forward (after the first, which records the
    order) starts each next unit while the current one runs: the 3 layers and the head. A
    bucket of 0 starts nothing ahead."""
    r = results[0]
    assert r["blocks, bucket of 1 element"]["forward_prefetches"] == LAYERS + 1
    assert r["blocks"]["forward_prefetches"] == LAYERS + 1       # "auto" (0.9 x 16^2) likewise
    assert r["blocks, no prefetch"]["forward_prefetches"] == 0


def test_a_parameter_read_outside_its_module_pickles(tmp_path):
    """``torch.save(p.cpu())`` of a released stage-3 parameter (DeepSpeed-Chat's save does
    it on its whole-parameter path): the read gathers the unit, and what is saved is the
    parameter's values, nothing of the engine (a block's unit is sharded, not persistent)."""
    from tests.support.toy import ToyNet, batches, train_steps
    torch.manual_seed(0)
    model = ToyNet()
    engine = zeroplug.initialize(model, {
        "zero": {"plugin": "stage3"}, "batch": {"micro_batch_size": 4}, "monitor": {"plugin": "none"},
        "offload": {"optimizer": {"plugin": "cpu"}, "param": {"plugin": "cpu"}}})
    train_steps(engine, batches(2, 4), 2)
    weight = model.blocks[0][0].weight
    assert type(weight).__name__ == "ReleasedParam"
    torch.save({"w": weight.cpu()}, tmp_path / "w.pt")
    saved = torch.load(tmp_path / "w.pt", weights_only=True)["w"]
    with engine.gathered_parameters():
        assert torch.equal(saved, model.blocks[0][0].weight.detach())
    engine.close()
