"""The handle of one transfer of the :class:`~.swapper.AsyncSwapper`."""
from __future__ import annotations

from concurrent.futures import Future as _CFuture
from typing import Hashable


class SwapFuture:
    """The result of :meth:`AsyncSwapper.write` / :meth:`AsyncSwapper.read`."""

    def __init__(self, fut: _CFuture, key: Hashable, nbytes: int, owner):
        self._fut, self.key, self.nbytes, self._owner = fut, key, nbytes, owner

    @property
    def future(self) -> _CFuture:
        """The transfer's ``concurrent.futures.Future`` (what the swapper tracks)."""
        return self._fut

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raises the transfer's :class:`SwapError` (once seen here,
        :meth:`AsyncSwapper.wait_all` does not raise it again)."""
        try:
            self._fut.result(timeout)
        except BaseException:
            if self._fut.done():
                self._owner.error_seen(self._fut)
            raise

    def done(self) -> bool:
        return self._fut.done()

    def exception(self, timeout: float | None = None):
        return self._fut.exception(timeout)

    def __repr__(self) -> str:
        return f"SwapFuture({self.key!r}, {self.nbytes} bytes, {'done' if self.done() else 'pending'})"
