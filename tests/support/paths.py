"""The repository's root, and the environment a child process needs to import ``tests.*``."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env(env: dict | None = None, **extra: str) -> dict[str, str]:
    """``env`` (default: this process's environment) with the repository root first on PYTHONPATH.

    Note: pytest puts the root on ``sys.path`` and spawned ranks inherit it, but a script run as a
    file (``python -c``, ``python x.py``, torchrun) starts from its own folder and needs the root
    from its environment to import ``tests.support``."""
    e = dict(os.environ if env is None else env)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH", "")) if p)
    e.update(extra)
    return e
