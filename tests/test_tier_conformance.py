"""The built-in offload tiers and the example third-party tier (examples/compressed_tier)
pass the conformance suite (zeroplug.testing) that a third-party tier runs in its own CI."""
import sys
from pathlib import Path

import pytest

from zeroplug.registry import PluginManager
from zeroplug.testing import TierConformance

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "compressed_tier"


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
            sys.path.insert(0, str(EXAMPLE))
            try:
                import zeroplug_compressed
            finally:
                sys.path.remove(str(EXAMPLE))
            pm = PluginManager()
            if not pm.pm.has_plugin("compressed_tier"):
                pm.register(zeroplug_compressed, "compressed_tier")
            type(self)._pm = pm
        return type(self)._pm


def test_suite_catches_a_tier_that_breaks_the_contract(tmp_path):
    """A tier that publishes nothing (the shards never change) fails the exactness check."""
    from zeroplug import hookimpl
    from zeroplug.plugins.offload_cpu import CPUOffload
    from zeroplug.testing import check_exact

    class Lazy(CPUOffload):
        """Steps but never publishes (adamw takes the path that publishes the fp32 master)."""
        def publish_master(self, master, a, k):
            pass

    class Plugin:
        @hookimpl
        def zeroplug_register_offload_devices(self, register):
            register("lazy", Lazy)

    pm = PluginManager()
    pm.register(Plugin(), "lazy")
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
