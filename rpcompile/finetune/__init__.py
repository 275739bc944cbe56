"""``rpcompile train``: fine-tune a checkpoint folder on a data file, with the RoundPipe runtime.

Modules, in reading order:

- config: the options table (:data:`OPTIONS`) behind the flags, ``--config`` YAML and the run's
  ``config.yaml``, their precedence, and the checks of options that cannot run together;
- model: the model and tokenizer (a folder, the local Hugging Face cache, or a shipped config
  built with random weights), bitsandbytes quantization and LoRA;
- data: the check that the data gives at least one batch of rows;
- metrics: eval loss, metrics.jsonl and reporters, the predicted step time, summary.json and
  loss.png;
- job: one run (:class:`_Job`): run folder, data, compile, LR schedule, the step loop with eval
  and checkpoints, ``final/``, and the stop on SIGINT / SIGTERM;
- command: :func:`run`, the entry the command line calls.
"""

from rpcompile.finetune.command import run
from rpcompile.finetune.config import (
    DEMO,
    OPTIONS,
    add_train_arguments,
    plan_cache_option,
    resolve_options,
)

# Re-exported for the tests, which check them through the package's name.
from rpcompile.finetune.config import _check as _check
from rpcompile.finetune.config import option_origin as option_origin
from rpcompile.finetune.job import _Job as _Job
from rpcompile.finetune.job import lr_lambda as lr_lambda

__all__ = ["DEMO", "OPTIONS", "add_train_arguments", "plan_cache_option", "resolve_options",
           "run"]
