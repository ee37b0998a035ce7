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


class RanksDisagree(ZeroplugError, RuntimeError):
    """Ranks were about to run different collectives, or disagree on a setting or an argument
    that every rank must share (zeroplug.faults): every rank raises it, with the same message,
    before any of them blocks."""
