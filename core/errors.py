"""Errors that zeroplug raises on purpose.

Note: every error a user can cause by a config or a command-line mistake is a
``ZeroplugError``; the CLI prints its message (never a traceback) and exits 2.
"""


class ZeroplugError(Exception):
    """Base class: a mistake the user can fix; the message says how."""


class ConfigError(ZeroplugError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range.

    ``key`` is the full dotted path (``zero.reduce_bucket_size``) when one key is at fault.
    """

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class PluginError(ZeroplugError):
    """A plugin could not be found, loaded or registered."""


class HostMemoryError(ZeroplugError, MemoryError):
    """The host lacks the memory an offload tier needs; raised before anything is allocated."""


class StateError(ZeroplugError, RuntimeError):
    """An engine method was called in a state that does not allow it."""


class StepFailedError(StateError):
    """An optimizer step failed part-way (a disk error of the swap files, an exception in the
    optimizer): some states may be updated and others not. The engine then refuses to train
    on or to save that state until a checkpoint is loaded."""

    def __init__(self, what: str, reason: str):
        super().__init__(
            f"engine.{what}() refused: {reason}. The model and optimizer states may be half updated, so "
            f"they are neither trained on nor saved; resume from the last checkpoint "
            f"(engine.load_checkpoint(dir), or zeroplug train --resume)")
        self.reason = reason


def allocation_failure(exc: BaseException) -> str | None:
    """torch's one line that says how much host memory an allocation that failed asked for
    (from its multi-line ``RuntimeError``), else None when ``exc`` is not such a failure."""
    text = str(exc)
    at = text.find("DefaultCPUAllocator")
    if at < 0:
        return None
    return text[at:].strip().splitlines()[0][:200]


def memory_available() -> str:
    """``; this host has N GiB available`` (MemAvailable), or "" where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for ln in f:
                if ln.startswith("MemAvailable:"):
                    return f"; this host has {int(ln.split()[1]) / 2**20:.1f} GiB available"
    except (OSError, ValueError, IndexError):
        pass
    return ""
