"""``torch.compile`` under zeroplug: the whole model or each block, stages 1-3, 1 and 2
ranks, with and without CPU offload, trains as the same engine does in eager mode.

Stage 3 gathers and frees parameter storage in module hooks (``resize_`` of a storage
and collectives), which Inductor cannot lower ("TODO: dynamic shapes, target:
inductor.resize_storage_bytes_"). The hooks run outside the compiled graphs (a graph break
at each gathering module, as FSDP2's hooks), so each module's forward compiles over
parameters that are already gathered. Every case here runs eagerly and compiled in the
same process, from the same seed, on the same data.

Tolerance: Inductor fuses and reorders floating-point work (fp32 here), so compiled and
eager differ by rounding only: 1e-5 relative on each step's loss and 1e-4 absolute on the
final parameters (Adam's normalised step turns a rounding-sized gradient difference into
at most a few ulps of lr per step on a weight whose gradient is near zero).
"""
from __future__ import annotations

import pytest
import torch

import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests.support.distributed import run_ranks
from tests.support.toy import batches

STEPS = 3
GLOBAL_BATCH = 4
LR = 1e-2
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-4
TIMEOUT = 900       # seconds for one spawn's cases together (Inductor compiles on a busy CPU)


class Block(torch.nn.Module):
    """A pre-norm residual MLP block, defined here: ``block.compile()`` compiles user code
    (Dynamo skips the frames of torch.nn's own modules, such as a bare Sequential's)."""

    def __init__(self, d, hidden):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(self.norm(h))))


class Net(torch.nn.Module):
    def __init__(self, vocab=37, d=24, hidden=50, checkpointing=False):
        super().__init__()
        self.checkpointing = checkpointing      # activation checkpointing of every block
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d, hidden) for _ in range(2))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=False) if self.checkpointing else b(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def _config(stage, world, variant=None):
    """``variant``: "optimizer" / "param" offloaded to the CPU, or "per-module": stage 3 gathers
    each module on its own (``stage3_block_units = false``; by default each block is one unit)."""
    cfg = {"zero": {"plugin": f"stage{stage}"}, "precision": {"plugin": "fp32"},
           "optimizer": {"plugin": "adamw", "lr": LR, "weight_decay": 0.01},
           "batch": {"micro_batch_size": GLOBAL_BATCH // world, "gradient_clipping": 0.0,
                     "steps_per_print": 10_000},
           "monitor": {"plugin": "none"}}
    if stage == 3:      # every module sharded and gathered on use, also on one rank
        cfg["zero"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=100_000)
    if variant == "per-module":
        cfg["zero"]["stage3_block_units"] = False
    elif variant:
        cfg["offload"] = {"optimizer": {"plugin": "cpu"}}
        if variant == "param":
            cfg["offload"]["param"] = {"plugin": "cpu"}
    return cfg


def _train(rank, world, config, how, dynamic=None):
    """Losses and the consolidated parameters of STEPS steps. ``how``: eager; whole
    (``torch.compile(model)`` handed to ``initialize``); inplace (``model.compile()`` after
    ``initialize``); block (``block.compile()`` on each block after ``initialize``); a
    ``-ckpt`` suffix checkpoints every block's activations."""
    import zeroplug
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    how, ckpt = how.removesuffix("-ckpt"), how.endswith("-ckpt")
    model = Net(checkpointing=ckpt)
    engine = zeroplug.initialize(torch.compile(model, dynamic=dynamic) if how == "whole" else model, config)
    if how == "inplace":
        model.compile(dynamic=dynamic)
    elif how == "block":
        for block in model.blocks:
            block.compile(dynamic=dynamic)
    per = GLOBAL_BATCH // world
    losses = []
    for x, y in batches(STEPS, GLOBAL_BATCH):
        loss = engine(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        engine.run.comm.all_reduce(t)
        losses.append(t.item() / world)
    state = engine.consolidated_state_dict()
    if state is not None:       # (torch.compile's wrapper names the model _orig_mod)
        state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    from zeroplug.plugins.zero.untraced import eager
    hook_code = eager(lambda: None).__code__        # (one code object for every stage-3 hook)
    graphs = {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
              "hook_frames": len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(hook_code))}
    return losses, state, graphs


# (name, stage, variant, how, dynamic) per world size; each runs compiled and eager. One
# rank gathers per use only with the parameters offloaded (else the fp32 model stays whole).
CASES = {
    1: [("stage1-whole", 1, None, "whole", None),
        ("stage2-block", 2, None, "block", None),
        ("stage3-whole-offload-param", 3, "param", "whole", None),
        ("stage3-block-offload-param", 3, "param", "block", None),
        ("stage3-whole-ckpt-offload-param", 3, "param", "whole-ckpt", None)],
    2: [("stage1-whole", 1, None, "whole", None),
        ("stage2-inplace-offload", 2, "optimizer", "inplace", None),
        ("stage3-whole", 3, None, "whole", None),
        ("stage3-inplace-static", 3, None, "inplace", False),
        ("stage3-block", 3, None, "block", None),                # each block one unit: one graph
        ("stage3-block-per-module", 3, "per-module", "block", None),
        ("stage3-whole-offload-param", 3, "param", "whole", None)],
}


def run_world(rank, world):
    out = {}
    for name, stage, variant, how, dynamic in CASES[world]:
        cfg = _config(stage, world, variant)
        out[name] = {"eager": _train(rank, world, cfg, "eager"),
                     "compiled": _train(rank, world, cfg, how, dynamic)}
    return out


@pytest.fixture(scope="module")
def one_rank():
    return run_ranks(run_world, 1)[0]


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(run_world, 2, timeout=TIMEOUT)[0]


def _compare(name, res):
    (eager_losses, eager_state, _), (losses, state, graphs) = res["eager"], res["compiled"]
    assert graphs["graphs"] >= 1, f"{name}: nothing was compiled"
    # the hooks are never compiled themselves (reached from torch.nn's skipped frames under
    # checkpointing, Dynamo would compile them, recompiling up to its limit)
    assert graphs["hook_frames"] == 0, f"{name}: {graphs['hook_frames']} compiled frames of the hooks"
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, eager_losses))
    assert worst <= LOSS_RTOL, f"{name}: losses differ by {worst:.3g}\n{losses}\n{eager_losses}"
    assert eager_losses[-1] < eager_losses[0], "the run must train"
    assert set(state) == set(eager_state)
    for k, v in eager_state.items():
        diff = (state[k] - v).abs().max().item()
        assert diff <= PARAM_ATOL, f"{name}: {k} differs by {diff:.3g}"


@pytest.mark.parametrize("name", [c[0] for c in CASES[1]])
def test_compiled_matches_eager_one_rank(name, one_rank):
    _compare(name, one_rank[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in CASES[2]])
def test_compiled_matches_eager_two_ranks(name, two_ranks):
    _compare(name, two_ranks[name])


@pytest.mark.slow
def test_a_block_unit_compiles_without_breaks(two_ranks):
    """Gathered per module, a compiled block breaks at each of its Linears; a block that is
    one unit is gathered in its own pre-hook: the breaks are at its boundary only."""
    per_module = two_ranks["stage3-block-per-module"]["compiled"][2]
    block = two_ranks["stage3-block"]["compiled"][2]
    assert block["breaks"] < per_module["breaks"], (block, per_module)
    assert block["graphs"] == 1, block      # both blocks run the one graph of Block.forward
