"""Adapters that run zeroplug inside training loops users already have.

* :mod:`zeroplug.integrations.transformers` — ``ZeroplugTrainer``, a Hugging Face
  ``transformers.Trainer`` that trains with the zeroplug engine (``pip install zeroplug[hf]``).
* :mod:`zeroplug.integrations.lightning` — ``ZeroplugStrategy``, a Lightning strategy
  (``pip install zeroplug[lightning]``).

Note: this package imports neither library; each submodule imports its own when it is
imported, so ``import zeroplug`` never pays for (or needs) them.
"""
