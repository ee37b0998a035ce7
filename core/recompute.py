"""What activation checkpointing saves for the backward: which saved tensors are the inputs of
checkpointed blocks (what their recompute starts from).

``torch.utils.checkpoint`` saves a checkpointed block's tensor inputs as saved tensors of
autograd: the reentrant variant through its autograd Function, the non-reentrant one just
before it takes over the saving of everything inside the block. A ``saved_tensors_hooks``
pack hook entered around a forward sees those saves among the ones made outside checkpointed
blocks (embeddings, head, loss) and tells them apart by who saves them. Used by the ``cpu``
activation store (plugins/activations) and by the memory probe of ``zeroplug estimate`` and
``zeroplug tune``.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.utils.checkpoint

_TORCH_AUTOGRAD = os.path.dirname(torch.autograd.__file__) + os.sep
_TORCH_CHECKPOINT = torch.utils.checkpoint.__file__


def saved_by_checkpoint(depth: int = 2) -> bool:
    """Whether the tensor being packed now is saved by ``torch.utils.checkpoint`` itself (a
    checkpointed block's input). Called from a pack hook (``depth`` 2: the hook's caller is the
    frame above it), or ``depth - 2`` frames below one."""
    frame = sys._getframe(depth)
    # Note: the saving code calls into torch.autograd (Function.apply, SavedTensor), which
    # calls the hook; the first frame outside torch.autograd is who asked.
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_AUTOGRAD):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename == _TORCH_CHECKPOINT
