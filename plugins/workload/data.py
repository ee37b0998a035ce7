"""Training data: a byte-level corpus (the Python standard library's own sources, read at
run time, or any text file) cut into random windows, and random tokens for benchmarks.

Standalone: imports only torch and the stdlib.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_corpus(max_bytes: int | None = None) -> bytes:
    """The Python standard library's ``*.py`` sources, concatenated as bytes.

    Files are taken in sorted path order (deterministic for a given Python installation),
    skipping site-packages and test directories; each file is followed by a newline.
    ``max_bytes`` truncates the result (reading stops once enough is read)."""
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    chunks: list[bytes] = []
    total = 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        chunks.append(b"\n")
        total += len(data) + 1
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = b"".join(chunks)
    if not corpus:
        raise RuntimeError(f"no Python sources found under the standard library path {root}")
    return corpus if max_bytes is None else corpus[:max_bytes]


def load_text(path: str | os.PathLike) -> bytes:
    """The bytes of the file at ``path``; clear errors naming the file if it is missing or
    empty."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"training data file not found: {str(p)!r}")
    if not p.is_file():
        raise IsADirectoryError(f"training data path is not a file: {str(p)!r}")
    data = p.read_bytes()
    if not data:
        raise ValueError(f"training data file is empty: {str(p)!r}")
    return data


def min_corpus_bytes(seq_len: int, holdout: float = 0.05) -> int:
    """The smallest corpus :class:`ByteBatches` can cut into training windows of
    ``seq_len + 1`` bytes and (for ``eval_batch``) a held-out part of one window."""
    n = seq_len + 1
    if holdout > 0:
        n = max(n, int((seq_len + 1) / holdout))
    while not (n - int(n * holdout) >= seq_len + 1 and (holdout == 0 or int(n * holdout) >= seq_len + 1)):
        n += 1
    return n


def _as_uint8(data: bytes | bytearray | torch.Tensor) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data.to(torch.uint8).flatten().cpu()
    # bytearray copy: torch.frombuffer needs a writable buffer to avoid a warning.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _mix_seed(seed: int, rank: int, stream: int = 0) -> int:
    # A simple deterministic mix so that (seed, rank, stream) triples give unrelated streams.
    x = (seed * 0x9E3779B1 + rank * 0x85EBCA77 + stream * 0xC2B2AE3D) & 0xFFFFFFFFFFFF
    return x ^ (x >> 17)


class ByteBatches:
    """Infinite iterator of ``(x, y)`` LongTensor batches of shape (micro_batch, seq_len):
    random windows of a byte corpus, ``y`` being ``x`` shifted by one.

    The last ``holdout`` fraction (default 5%) of the corpus is held out: training windows
    never touch it, ``eval_batch()`` draws only from it. The window sequence is
    deterministic given ``seed`` and ``rank``; different ranks draw different windows
    (independent streams; the union over ranks is not invariant to the world size)."""

    def __init__(
        self,
        data: bytes | bytearray | torch.Tensor,
        micro_batch: int,
        seq_len: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
        holdout: float = 0.05,
    ) -> None:
        if micro_batch <= 0 or seq_len <= 0:
            raise ValueError(f"micro_batch and seq_len must be positive, got {micro_batch}, {seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
        if not 0.0 <= holdout < 1.0:
            raise ValueError(f"holdout must be in [0, 1), got {holdout}")
        tokens = _as_uint8(data)
        n_eval = int(len(tokens) * holdout)
        self.train_data = tokens[: len(tokens) - n_eval]
        self.eval_data = tokens[len(tokens) - n_eval :]
        if len(self.train_data) < seq_len + 1:
            raise ValueError(
                f"corpus too small: {len(self.train_data)} training bytes for windows of {seq_len + 1}"
            )
        self.micro_batch = micro_batch
        self.seq_len = seq_len
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.steps = 0
        self._gen = torch.Generator().manual_seed(_mix_seed(seed, rank))
        self._offsets = torch.arange(seq_len + 1)

    def _windows(self, src: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = src[starts[:, None] + self._offsets].long()
        x, y = chunk[:, :-1], chunk[:, 1:]
        if self.device.type != "cpu":
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
        return x.contiguous(), y.contiguous()

    def __iter__(self) -> "ByteBatches":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        high = len(self.train_data) - self.seq_len  # start in [0, len - seq_len - 1]
        starts = torch.randint(0, high, (self.micro_batch,), generator=self._gen)
        self.steps += 1
        return self._windows(self.train_data, starts)

    def eval_batch(self, batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed batch (the same on every call and every rank, given ``seed``) from the
        held-out tail of the corpus."""
        n = self.micro_batch if batch_size is None else batch_size
        if len(self.eval_data) < self.seq_len + 1:
            raise ValueError(
                f"holdout too small for an eval batch: {len(self.eval_data)} bytes for windows "
                f"of {self.seq_len + 1}; use a larger corpus or holdout fraction"
            )
        gen = torch.Generator().manual_seed(_mix_seed(self.seed, 0, stream=1))
        starts = torch.randint(0, len(self.eval_data) - self.seq_len, (n,), generator=gen)
        return self._windows(self.eval_data, starts)

    def state_dict(self) -> dict:
        return {"generator": self._gen.get_state(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self._gen.set_state(state["generator"])
        self.steps = int(state["steps"])


class RandomTokens:
    """Infinite iterator of ``(x, y)`` batches of uniformly random tokens in
    [0, vocab_size), shape (micro_batch, seq_len), ``y`` = ``x`` shifted by one; generated
    directly on ``device`` (no host work per step). Deterministic given seed and rank."""

    def __init__(
        self,
        vocab_size: int,
        micro_batch: int,
        seq_len: int,
        seed: int = 0,
        device: str | torch.device = "cpu",
        rank: int = 0,
    ) -> None:
        self.vocab_size = vocab_size
        self.micro_batch = micro_batch
        self.seq_len = seq_len
        self.device = torch.device(device)
        self._gen = torch.Generator(device=self.device).manual_seed(_mix_seed(seed, rank, stream=2))

    def __iter__(self) -> "RandomTokens":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(
            0,
            self.vocab_size,
            (self.micro_batch, self.seq_len + 1),
            generator=self._gen,
            device=self.device,
        )
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


__all__ = ["stdlib_corpus", "load_text", "min_corpus_bytes", "ByteBatches", "RandomTokens"]
