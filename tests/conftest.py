"""The suite runs with every compile pass's invariants checked (RPCOMPILE_DEBUG=1), unless the
environment says otherwise."""

import os

os.environ.setdefault("RPCOMPILE_DEBUG", "1")
