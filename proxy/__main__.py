"""``python -m proxy ...`` does the same as ``sluice ...``."""

import sys

from proxy.cli import main

sys.exit(main())
