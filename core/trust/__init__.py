"""What zeroplug trusts on a machine shared with other users, and how it holds what it made.

Two questions, as ssh and pip ask them:

* **Code** (the compiled kernel cache): a directory is trusted for code when it and each of
  its ancestors is owned by this user or root and no one else can write it, except an
  ancestor owned by root (or this user) with the sticky bit (``/tmp``), where others may
  add entries but not rename or remove this user's. Everything inside must be owned by this
  user or root too. :func:`code_dir_problem` says why a directory fails, or None.
* **Data** (swap files): a directory others can write (a shared scratch disk) is used only
  through a private subdirectory made with ``mkdir(0700)`` and then held by a descriptor
  (:class:`HeldDir`): its owner and mode are checked on the descriptor, and every later
  open, unlink, rename and listing is relative to it, with no link followed. Renaming the
  directory or putting a link in its place afterwards redirects nothing.

A group-writable entry counts as writable by others unless its group is this user's own
private group (named after the user, with no other member), which ``umask 002`` systems
give every file.

Temporary files are made exclusively (``O_CREAT | O_EXCL``, random names), never at
predictable ones: :func:`atomic_write`.

Text that another user can write (a lock file's record) is shown through :func:`printable`,
which escapes control characters, so that it cannot drive the terminal.
"""
from .dirs import (ancestors_problem, atomic_write, code_dir_problem, data_dir_problem, existing_ancestor,
                   make_dirs, open_append, others_can_write, tree_problem)
from .held import HeldDir, UntrustedDirError
from .text import printable, torch_load_reason

__all__ = ["printable", "torch_load_reason", "others_can_write", "code_dir_problem", "data_dir_problem",
           "ancestors_problem", "tree_problem", "existing_ancestor", "make_dirs", "atomic_write", "open_append",
           "HeldDir", "UntrustedDirError"]
