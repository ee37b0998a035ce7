"""The example tier passes zeroplug's conformance suite and trains through `zeroplug train`."""
import subprocess
import sys

import torch

from zeroplug.testing import TierConformance
from zeroplug_compressed import pack, unpack


class TestCompressedTier(TierConformance):
    tier = "compressed"


def test_pack_round_trip_is_exact_and_smaller():
    t = torch.randn(10_000) * 1e-3
    blob = pack(t, 1)
    out = torch.empty_like(t)
    unpack(blob, out)
    assert torch.equal(out, t)
    assert len(blob) < t.numel() * 4          # the exponent bytes deflate


def test_trains_through_the_cli():
    out = subprocess.run([sys.executable, "-m", "zeroplug.cli", "train", "--no-save", "--steps", "3", "--max-bytes", "200000",
                          "--offload.optimizer.plugin=compressed", "--zero.plugin=stage2", "--monitor.plugin=none"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "train loss: first step" in out.stdout
