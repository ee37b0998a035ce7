"""The built-in offload tiers and the example third-party tier (examples/compressed_tier)
pass the conformance suite (zeroplug.testing) that a third-party tier runs in its own CI."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from zeroplug.registry import PluginManager
from zeroplug.testing import TierConformance

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "compressed_tier"


def _import_example():
    """The example's package from its folder (installed or not), as its users import it."""
    name = "zeroplug_compressed"
    if name not in sys.modules:
        pkg = EXAMPLE / name
        spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module          # its own relative imports find it
        spec.loader.exec_module(module)
    return sys.modules[name]


class TestCPUTier(TierConformance):
    tier = "cpu"


class TestNVMeTier(TierConformance):
    tier = "nvme"

    def options(self, tmp_path):
        (tmp_path / "swap").mkdir(exist_ok=True)
        return {"nvme_path": str(tmp_path / "swap")}


class TestExampleTier(TierConformance):
    """The example package, registered as its entry point would register it."""
    tier = "compressed"

    def plugin_manager(self):
        if not hasattr(type(self), "_pm"):
            zeroplug_compressed = _import_example()
            pm = PluginManager()
            if not pm.pm.has_plugin("compressed_tier"):
                pm.register(zeroplug_compressed, "compressed_tier")
            type(self)._pm = pm
        return type(self)._pm


def _manager_with_tier(name: str, cls) -> PluginManager:
    """A plugin manager with the tier class ``cls`` registered as ``name``, as a third-party
    plugin registers it."""
    from zeroplug import hookimpl

    class Plugin:
        @hookimpl
        def zeroplug_register_offload_devices(self, register):
            register(name, cls)

    pm = PluginManager()
    pm.register(Plugin(), name)
    return pm


def test_suite_catches_a_tier_that_breaks_the_contract(tmp_path):
    """A tier that publishes nothing (the shards never change) fails the exactness check."""
    from zeroplug.plugins.offload_cpu import CPUOffload
    from zeroplug.testing import check_exact

    class Lazy(CPUOffload):
        """Steps but never publishes (adamw takes the path that publishes the fp32 master)."""
        def publish_master(self, master, a, k):
            pass

    pm = _manager_with_tier("lazy", Lazy)
    with pytest.raises(AssertionError, match="lazy at stage2"):
        check_exact("lazy", {}, "stage2", plugin_manager=pm)


def test_a_tier_for_optimizer_states_only_is_refused_for_parameters():
    import zeroplug
    from zeroplug.config import load
    from zeroplug.testing import config
    pm = TestExampleTier().plugin_manager()
    cfg = config("stage3", "compressed", params=True)
    with pytest.raises(zeroplug.ConfigError, match=r"offload.param.plugin = \"compressed\" holds only optimizer"):
        load(cfg, pm=pm)


def _fine_tier_manager(granularity: int):
    """A plugin manager with "fine": the cpu tier, asking for ``granularity`` elements at a time."""
    import dataclasses

    from zeroplug.plugins.offload_cpu import CPUOffload

    class Fine(CPUOffload):
        @property
        def capabilities(self):
            return dataclasses.replace(super().capabilities, granularity=granularity)

    return _manager_with_tier("fine", Fine)


@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_the_stage_cuts_buckets_and_sub_groups_at_the_tiers_granularity(stage):
    """The config asks for buckets and sub-groups of 5000 elements (the whole model); a tier
    that takes 700 at a time gets sub-groups (and, below stage 3, buckets) of at most 700,
    and the run stays bit for bit the one without offload."""
    from zeroplug.testing import batches, config, engine, train, weights

    def cfg(tier):
        c = config(stage, tier)
        c["zero"].update(reduce_bucket_size=5000, sub_group_size=5000)
        return c
    data = batches(3)
    ref = engine(cfg(None))
    ref_losses, ref_w = train(ref, data), weights(ref)
    ref.close()
    coarse = engine(cfg("cpu"))
    assert len(coarse.partitioner.sub_group_ranges) == 1
    coarse.close()
    eng = engine(cfg("fine"), _fine_tier_manager(700))
    part = eng.partitioner
    sizes = [hi - lo for lo, hi in part.sub_group_ranges]
    assert len(sizes) > 2 and max(sizes) <= 700, sizes
    if stage == "stage2":
        assert len(part.units) > 2 and max(u.hi - u.lo for u in part.units) <= 700
    assert train(eng, data) == ref_losses
    w = weights(eng)
    eng.close()
    for k in ref_w:
        assert torch.equal(w[k], ref_w[k]), k


def test_deepspeed_sizes_with_the_cpu_tier(caplog):
    """DeepSpeed's reduce_bucket_size 5e8 becomes buckets of 1e8 with the cpu tier (said at
    INFO) and stays 5e8 without offload."""
    import logging

    from zeroplug.testing import config, engine

    def cfg(tier):
        c = config("stage2", tier)
        c["zero"].update(reduce_bucket_size=5e8, sub_group_size=1e9)
        return c
    with caplog.at_level(logging.INFO, logger="zeroplug"):
        eng = engine(cfg("cpu"))
    assert eng.offload_optimizer.capabilities.granularity == 100_000_000
    assert eng.partitioner.bucket_size == 100_000_000
    assert "gradient buckets of 100000000 elements (reduce_bucket_size 500000000" in caplog.text
    eng.close()
    eng = engine(cfg(None))
    assert eng.partitioner.bucket_size == 500_000_000
    eng.close()
