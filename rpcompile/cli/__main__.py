"""``python -m rpcompile.cli ...``: the command line."""

from rpcompile.cli import main

raise SystemExit(main())
