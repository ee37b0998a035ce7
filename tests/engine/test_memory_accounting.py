"""What each rank really holds equals the ZeRO accounting, stage by stage.

Measured from the tensors' storages (``zeroplug.flat.storage_bytes``, deduplicated by
storage), never from an estimate: the partitioner's ``state_tensors()`` by kind, the
optimizer's state tensors, and the model's own parameters and ``.grad``.

Expected bytes per rank for Psi parameters on N ranks, model dtype of ``b`` bytes
(bf16: 2, fp32: 4), fp32 masters, Adam (m and v in fp32), measured at rest after a step:

=========  ===========  ===========  ============  ===========  ===============
stage      lp params    lp grads     hp params     hp grads     Adam m + v
=========  ===========  ===========  ============  ===========  ===============
0          b Psi        b Psi        4 Psi         0 (**)       8 Psi
1          b Psi        b Psi        4 Psi / N     0 (**)       8 Psi / N
2          b Psi        0 (*)        4 Psi / N     0 (**)       8 Psi / N
3          0 (***)      0 (*)        4 Psi / N     0 (**)       8 Psi / N
=========  ===========  ===========  ============  ===========  ===============

(*) stages 2-3 reduce-scatter each bucket of model-dtype gradients as soon as it is
full and drop it. (**) the fp32 gradient shard exists from its reduction until the
step, and is freed after it. (***) a gather casts the fp32 master shard: no model-dtype
shard is kept beside it.
With fp32 models the masters *are* the (shards of the) parameters (stage 3: b Psi / N
lp params) and, for stages 0-1, the master gradients are views of the flat gradient
buffer: hp params and (0-1) hp grads are then 0 bytes of their own.

"Up to padding": every flat unit is padded to a multiple of N, so a shard holds
ceil(Psi_u / N) elements of unit u: at most one element per unit above Psi / N.
``stage3_param_persistence_threshold = 0`` so that stage 3 shards every module;
``reduce_bucket_size = 2000`` so that stages 0-2 split ToyNet into several units.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, batches

WORLDS = (2, 4)
CASES = [(stage, prec) for prec in ("bf16", "fp32") for stage in (0, 1, 2, 3)]
KINDS = ("lp_params", "lp_grads", "hp_params", "hp_grads", "optim")


def _config(stage, precision, world):
    # small buckets: stages 0-2 form several units (each padded on its own)
    zero = {"plugin": f"stage{stage}", "reduce_bucket_size": 2000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"zero": zero,
            "precision": {"plugin": precision},
            "optimizer": {"plugin": "adamw", "lr": 1e-3},
            "batch": {"micro_batch_size": 2, "steps_per_print": 10_000},
            "monitor": {"plugin": "none"}}


def measure(rank, world):
    import zeroplug
    from zeroplug.flat import storage_bytes
    out = {}
    for stage, precision in CASES:
        torch.manual_seed(0)
        model = ToyNet()
        psi = sum(p.numel() for p in model.parameters())
        engine = zeroplug.initialize(model, _config(stage, precision, world))
        for x, y in batches(2, 2 * world):
            loss = engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
            engine.backward(loss)
            engine.step()
        part = engine.partitioner
        kinds = part.state_tensors()
        states = [s for st in engine.optimizer.state.values() for s in st.values() if torch.is_tensor(s)]
        mv = [st[k] for st in engine.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        got = {k: storage_bytes(kinds.get(k, [])) for k in KINDS[:-1]}
        got["optim"] = storage_bytes(mv)
        got["optim_other"] = storage_bytes(states) - got["optim"]    # Adam's "step" scalars
        every = [t for k in KINDS[:-1] for t in kinds.get(k, [])] + states
        params = list(model.parameters())
        out[(stage, precision)] = {
            "psi": psi, "units": len(part.units), "bytes": got,
            "all_distinct": storage_bytes(every) == sum(got.values()),
            "n_optim_tensors": len(engine.optimizer.state),
            "model_param_bytes": storage_bytes([p for p in params]),
            "model_grad_bytes": storage_bytes([p.grad for p in params]),
            "unit_states": [(u.state, u.persistent, u.full.untyped_storage().size()) for u in part.units],
            "shard_elems": sum(u.hi - u.lo for u in part.units),
        }
    return out


_CACHE: dict[int, list] = {}


@pytest.fixture(scope="module")
def measured():
    def get(world):
        if world not in _CACHE:
            _CACHE[world] = run_ranks(measure, world)
        return _CACHE[world]
    return get


def expected(stage, precision, psi, units, n):
    """kind -> (bytes from the table above, bytes of padding allowed on top)."""
    b = 2 if precision == "bf16" else 4
    alias = precision == "fp32"        # masters are the parameters' shards

    def whole(size):     # a full flat buffer: padded to a multiple of N (stages 1-2)
        return size * psi, 0 if stage == 0 else size * units * (n - 1)

    def shard(size):     # this rank's shard: ceil(Psi_u / N) elements per unit
        return (size * psi, 0) if stage == 0 else (size * psi / n, size * units)

    none = (0, 0)
    return {"lp_params": (shard(b) if alias else none) if stage == 3 else whole(b),
            "lp_grads": whole(b) if stage <= 1 else none,
            "hp_params": none if alias else shard(4),
            "hp_grads": none,
            "optim": shard(8)}


@pytest.mark.parametrize("stage,precision", CASES, ids=[f"stage{s}-{p}" for s, p in CASES])
@pytest.mark.parametrize("world", WORLDS)
def test_bytes_match_zero_accounting(world, stage, precision, measured):
    for rank, res in enumerate(measured(world)):
        r = res[(stage, precision)]
        got = r["bytes"]
        exp = expected(stage, precision, r["psi"], r["units"], world)
        for kind in KINDS:
            lo, slack = exp[kind]
            assert lo <= got[kind] <= lo + slack, (
                f"world {world} rank {rank} stage{stage} {precision}: {kind} holds {got[kind]} bytes, "
                f"ZeRO accounting says {lo:.0f} (+ up to {slack} of padding)")
        # Adam's per-tensor step counters: one fp32 scalar per master tensor at most
        assert got["optim_other"] <= 4 * r["n_optim_tensors"]
        assert r["all_distinct"], "two kinds of state share a storage: counted twice"
        # the model's parameters hold exactly the lp parameters (nothing at all for stage 3
        # after a step); gradients live in the flat buffers (stages 0-1) or nowhere (2-3)
        assert r["model_param_bytes"] == (got["lp_params"] if stage <= 2 else 0)
        assert r["model_grad_bytes"] == (got["lp_grads"] if stage <= 1 else 0)


def test_shards_partition_the_model(measured):
    """Summed over ranks, the shards hold every parameter once, plus padding."""
    for world in WORLDS:
        for stage, precision in CASES:
            if stage == 0:
                continue
            rs = [res[(stage, precision)] for res in measured(world)]
            psi, units = rs[0]["psi"], rs[0]["units"]
            total = sum(r["shard_elems"] for r in rs)
            assert psi <= total <= psi + units * (world - 1)
            assert len({r["shard_elems"] for r in rs}) == 1      # equal shards on every rank


@pytest.mark.parametrize("world", WORLDS)
def test_stage3_frees_every_unit_after_step(world, measured):
    for rank, res in enumerate(measured(world)):
        for precision in ("bf16", "fp32"):
            states = res[(3, precision)]["unit_states"]
            assert len(states) > 1
            for i, (state, persistent, size) in enumerate(states):
                assert not persistent, "persistence threshold 0: every unit is sharded"
                assert state == "free" and size == 0, \
                    f"world {world} rank {rank} {precision}: unit {i} still holds {size} bytes ({state})"
