"""``import zeroplug`` never imports the libraries of the integrations (optional extras)."""
from __future__ import annotations

import subprocess
import sys

HEAVY = ("transformers", "accelerate", "lightning", "pytorch_lightning", "peft")


def test_plain_import_leaves_the_integrations_unloaded():
    code = ("import sys, zeroplug, zeroplug.integrations, zeroplug.cli\n"
            "engine = zeroplug.initialize(__import__('torch').nn.Linear(2, 2), device='cpu')\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
