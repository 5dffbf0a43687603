"""``python -m muse_stack.cli``: the ``muse-stack`` command (as torchrun's ``--module`` starts it)."""

import sys

from muse_stack.cli import main

sys.exit(main())
