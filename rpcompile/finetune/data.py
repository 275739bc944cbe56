"""The training rows of ``rpcompile train`` (read, tokenized and packed by rpcompile.data):
data that gives fewer rows than one batch is refused with its cause and the option to change."""

from __future__ import annotations

from typing import Any

from rpcompile.errors import InvalidInput


def _check_rows(rows: Any, batch_size: int, prepared: Any, dropped: int, packed: bool,
                opts: dict[str, Any], data_path: str) -> None:
    """Refuse data that gives fewer rows than one batch, naming the cause: examples that
    --seq truncated to nothing to predict, an eval split that took most of the data, or
    simply too little data for --batch."""
    n = len(rows.rows)
    if n >= batch_size:
        return
    train, held = len(prepared.train), len(prepared.eval)
    causes = []
    if dropped:
        longest = max(len(e) for e in prepared.train)
        causes.append(f"{dropped} of the {train} training examples keep no token to predict "
                      f"once truncated to --seq {rows.seq_len} (their prompts are longer; the "
                      f"longest example has {longest} tokens): use a larger --seq, or "
                      "--no-completion-only")
    if held and not opts["eval_data"] and held >= train:
        causes.append(f"--eval-split {opts['eval_split']} holds out {held} of the "
                      f"{train + held} examples for eval, leaving {train} to train on: use a "
                      "smaller --eval-split, or give --eval-data FILE")
    if not causes:
        made = f"packed into {n} rows of --seq {rows.seq_len}" if packed else f"{n} rows"
        causes.append(f"{train} training examples make {made}: use a smaller --batch"
                      + (" or --seq" if packed else "") + ", or more data")
    raise InvalidInput(f"{data_path} gives {n} training rows, fewer than one batch of --batch "
                     f"{batch_size}: " + "; ".join(causes))
