"""``python -m aiodat``: the same as the ``aiodat`` command (see aiodat.cli)."""
import sys

from aiodat.cli import main

sys.exit(main())
