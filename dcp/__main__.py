"""``python -m dcp`` is the ``hyperdcp`` command."""

import sys

from dcp.tools.cli import main

sys.exit(main())
