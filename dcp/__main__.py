"""``python -m dcp`` is the ``hyperdcp`` command."""

import sys

from dcp.cli import main

sys.exit(main())
