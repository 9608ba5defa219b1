"""``python -m spmdkit``: the command line (what ``spmdkit run`` starts once per rank)."""

import sys

from spmdkit.cli import main

sys.exit(main())
