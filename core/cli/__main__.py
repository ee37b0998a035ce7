"""``python -m zeroplug.cli ...``: the ``zeroplug`` command."""
import sys

from . import main

sys.exit(main())
