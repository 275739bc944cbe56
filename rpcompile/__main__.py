"""``python -m rpcompile ...`` (and ``torchrun ... -m rpcompile train ...``): the CLI."""

import sys

from rpcompile.cli import main

sys.exit(main())
