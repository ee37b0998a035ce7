"""Each rank's record in the launcher's key-value store, where the other ranks read it.

Note: the watchdog thread publishes its rank's record (as a forward, backward or step begins,
four times a second while it changes, every few seconds otherwise) over a connection of its own to the store torchrun (or
``env://``) serves at MASTER_ADDR:MASTER_PORT, with a short timeout: the training thread's
own store client and its timeouts are left alone, and a store that is gone (its host rank
died) costs a failed read, never a wait. Without MASTER_ADDR / MASTER_PORT (a group started
from a file or a URL of the script's own) there is no store: messages then name this rank
only.
"""
from __future__ import annotations

import datetime
import json
import os

import torch.distributed as dist


class Peers:
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.store = None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"zeroplug/faults/attempt_{attempt}/"
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world > 1 and addr and port:
            try:
                self.store = dist.TCPStore(addr, int(port), is_master=False,
                                           timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
            except (RuntimeError, ValueError, OSError):
                self.store = None

    def publish(self, record: dict) -> None:
        if self.store is None:
            return
        try:
            self.store.set(f"{self.prefix}{self.rank}", json.dumps(record))
        except (RuntimeError, OSError):
            self.store = None       # the store is gone (its host died): records stay local

    def read(self) -> dict[int, dict]:
        """The other ranks' last records, by rank (missing: never published, or no store)."""
        out: dict[int, dict] = {}
        if self.store is None:
            return out
        for r in range(self.world):
            if r == self.rank:
                continue
            key = f"{self.prefix}{r}"
            try:
                if self.store.check([key]):
                    out[r] = json.loads(self.store.get(key))
            except (RuntimeError, OSError, ValueError):
                break
        return out


def peer_lines(peers: dict[int, dict], world: int, me: int, now_wall: float) -> list[str]:
    """One clause per other rank: where it is, or that it failed or left no record."""
    lines = []
    for r in range(world):
        if r == me:
            continue
        p = peers.get(r)
        if p is None:
            lines.append(f"rank {r}: no record")
            continue
        age = max(0.0, now_wall - p.get("wall", now_wall))
        stale = (f" (its last record, {age:.0f} s old: the rank died or is stuck outside Python)" if age > 5
                 else f" (as of {age:.1f} s before)")
        if p.get("failed"):
            lines.append(f"rank {r} failed: {p['failed']}{stale}")
        else:
            lines.append(f"rank {r}: {p.get('where', '?')}{stale}")
    return lines
