"""The reference GPT's configuration and its size presets, without torch: the command
line lists them (``zeroplug train --help``) before anything imports torch."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int  # maximum number of positions
    n_layer: int
    d_model: int
    n_head: int
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "d_model", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )

    def with_(self, **changes) -> "GPTConfig":
        """A copy with some fields changed (e.g. ``activation_checkpointing=True``)."""
        return replace(self, **changes)


_GPT2_VOCAB = 50_304
_GPT2_SEQ = 1_024

PRESETS: dict[str, GPTConfig] = {
    name: GPTConfig(_GPT2_VOCAB, _GPT2_SEQ, n_layer, d_model, n_head)
    for name, (n_layer, d_model, n_head) in {
        "125M": (12, 768, 12),
        "350M": (24, 1024, 16),
        "1.3B": (24, 2048, 16),
        "2.7B": (32, 2560, 32),
        "6.7B": (32, 4096, 32),
        "13B": (40, 5120, 40),
        # intermediate widths (32 layers, heads of 128): what fits in one GPU's memory
        "3.3B": (32, 2816, 22),
        "3.9B": (32, 3072, 24),
        "4.3B": (32, 3200, 25),
        "4.6B": (32, 3328, 26),
        "4.9B": (32, 3456, 27),
        "5.3B": (32, 3584, 28),
        "7.7B": (32, 4352, 34),
        "8.6B": (32, 4608, 36),
        # between 8.6B and 13B (40 layers, heads of 128): what fits one host's memory with offload
        "9.5B": (40, 4352, 34),
        "10.7B": (40, 4608, 36),
        "11.9B": (40, 4864, 38),
        # beyond 13B (heads of 128): what the hosts of several GPUs hold with offload
        "22B": (48, 6144, 48),
        "28B": (52, 6656, 52),
        "35B": (56, 7168, 56),
        "43B": (60, 7680, 60),
        "52B": (64, 8192, 64),
        "65B": (80, 8192, 64),
    }.items()
}
# Byte-level default for `zeroplug train` on a laptop-class CPU: about 0.8 M parameters;
# 300 steps of micro batch 16 take on the order of a minute on 2 cores.
PRESETS["char-tiny"] = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, d_model=128, n_head=4)


def get_preset(name: str, **changes) -> GPTConfig:
    """The preset ``name`` (see PRESETS), with optional field changes."""
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None
    return replace(cfg, **changes) if changes else cfg
