"""What ``zeroplug train`` trains: the reference GPT (:mod:`.models`, the presets of the
reference workload) on a byte-level corpus (:mod:`.data`, the Python standard library's
own sources by default), and the loop itself (:mod:`.train`). A built-in plugin on the
hooks a third party would use: it adds the ``train`` command and names its presets for
``zeroplug estimate`` and ``zeroplug tune``."""
from __future__ import annotations

from zeroplug import hookimpl


@hookimpl
def zeroplug_add_commands(subparsers):
    from .train import add_parser
    add_parser(subparsers)


@hookimpl
def zeroplug_model_presets():
    from .models import PRESETS
    return {name: (lambda checkpointing, name=name: preset_spec(name, checkpointing)) for name in PRESETS}


def preset_spec(name: str, checkpointing: bool):
    """The :class:`zeroplug.tools.probe.ModelSpec` of the preset ``name``."""
    from zeroplug.tools.probe import ModelSpec

    from .models import GPT, get_preset
    cfg = get_preset(name, activation_checkpointing=checkpointing)

    def build(layers):
        return GPT(cfg.with_(n_layer=layers) if layers else cfg)
    return ModelSpec(name, build, cfg.n_layer, cfg.vocab_size, hf=False, max_seq=cfg.seq_len)
