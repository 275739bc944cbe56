"""Command line: ``rpcompile plan | train | models | hardware``.

``rpcompile train`` fine-tunes a checkpoint folder on a data file: see rpcompile.finetune.
``rpcompile plan`` plans, schedules and simulates a shipped model on a hardware profile.

Modules, in reading order: parser (the flags), commands (:func:`main`), plan (the ``plan``
command: arguments checked, compile, simulation, its report's figures), reports (the report
objects and the one function that prints them); ``python -m rpcompile.cli`` runs
``__main__``.
"""

from rpcompile.cli.commands import main

# Re-exported for the tests, which read the flags through the package's name.
from rpcompile.cli.parser import _parser as _parser

__all__ = ["main"]
