"""The tree says what is true now; git keeps the history.

README.md, docs/, rpcompile/, tests/ and benchmarks/ may not narrate how the project got here:
numbered work periods, issue numbers, before/after comparisons, reruns, commit hashes, the
machine's load. Each pattern below names one of those and is precise enough to leave honest
technical words alone ("uploads before the compute", "a pytest session", "until the step
commits"). A hit names the file, the line and what to write instead: the reason or the
invariant, and the figure in docs/results.md.

``ALLOWED`` lists hits that are known and waiting for their file's owner, as (path, pattern
name, the hit's text). It only shrinks: an entry that matches nothing fails the test too, so
the list cannot outlive its hits.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve()

# One space in a pattern matches any run of spaces, line breaks and comment marks, so a phrase
# wrapped over two lines (of prose or of a Python comment) is still one phrase.
_GAP = r"[\s#>*]+"


def _pattern(text: str) -> re.Pattern[str]:
    return re.compile(text.replace(" ", _GAP), re.IGNORECASE)


PATTERNS: dict[str, re.Pattern[str]] = {name: _pattern(text) for name, text in {
    "a numbered work period":
        r"\bsessions? \d+|\b(?:this|that|the previous|the last|the next|an earlier|a later) "
        r"session\b|\bsession's (?:change|branch|tree|figures?|runs?|reruns?)\b",
    "an issue number": r"\bissues? #?\d+\b",
    "a before/after comparison":
        r"\bbefore/after\b|\b(?:before|after|until) (?:this|that|the) (?:change|fix|commit|"
        r"session|merge|rewrite|refactor|patch)\b|\bthe tree (?:before|after)\b|"
        r"\b(?:was|were) [-+]?[\d.,]+(?:\s?(?:%|ms|s|GiB|MiB|GB|MB|x))? before\b",
    "a change narrated":
        r"\bthis (?:change|commit|patch|release)\b|\b(?:an?|the) (?:earlier|older|previous|old) "
        r"(?:release|version|tree|commit|branch|simulator|kernel|lowering|partitioner)\b|"
        r"\bnow fixed\b|\bfixed in (?:session|commit|issue)\b|\buntil (?:now|recently)\b|"
        r"\bfound by review\b|(?<!\bis\s)(?<!\bare\s)(?<!\bbe\s)(?<!\bwas\s)\bused to (?:fail|hang|leak|"
        r"flake|crash|deadlock|predict|count|replace|leave)\b",
    "a rerun":
        r"\bre-?ran\b|\bre-?runs? in bold\b|\bre-?run (?:in|after the|on the tree)\b|"
        r"\bnot (?:been )?re-?run (?:since|after|in|here)\b",
    "a machine load": r"\bload average|\bload (?:of )?[\d.]+(?:-[\d.]+)? on (?:the )?\d",
    # Seven to twelve hex digits with a letter and a digit, standing alone: an abbreviated
    # commit. Hex literals (0x...), checksums (64 digits) and identifiers do not match.
    "a commit hash":
        r"(?-i:(?<![\w.#/-])(?=[0-9a-f]{7,12}\b)(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])"
        r"[0-9a-f]{7,12}\^?(?![\w-]))",
}.items()}

# The results page carries each figure's stamp, the commit that made it: data, not prose.
EXEMPT = {("docs/results.md", "a commit hash")}

# Known hits to be reworded, each (path, pattern name, text of the hit); none today.
ALLOWED: set[tuple[str, str, str]] = set()


def _files() -> list[Path]:
    out = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("rpcompile", "tests", "benchmarks"):
        out += sorted(p for p in (ROOT / folder).rglob("*.py") if p.resolve() != SELF)
    return out


def _hits() -> list[tuple[str, int, str, str]]:
    hits = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        for name, pattern in PATTERNS.items():
            if (rel, name) in EXEMPT:
                continue
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                hits.append((rel, line, name, " ".join(m.group(0).split())))
    return hits


def test_the_tree_narrates_no_history():
    hits = _hits()
    new = [h for h in hits if (h[0], h[2], h[3]) not in ALLOWED]
    assert not new, "the tree narrates its history (write the reason or the invariant " \
        "instead; figures belong in docs/results.md, written by benchmarks/report.py):\n" + \
        "\n".join(f"  {path}:{line}: {name}: {text!r}" for path, line, name, text in new)
    seen = {(h[0], h[2], h[3]) for h in hits}
    stale = sorted(ALLOWED - seen)
    assert not stale, f"ALLOWED entries that match nothing any more, remove them: {stale}"


def test_the_patterns_catch_history_and_leave_technical_words_alone():
    history = [
        "rerun in session 12 with the staging", "(issue 14)", "before this session's change",
        "the tree before and after", "(was 1.26 before `close()`", "Before/after reruns",
        "see commit fe92168^", "load average 6", "load 3.3-5.6 on 2 cores",
        "the old simulator let any ready transfer go first", "not rerun since", "it used to fail",
        "until this change", "(found by review: each block)",
    ]
    honest = [
        "uploads before the compute", "a pytest session", "until the step commits",
        "the buffer is used to stage downloads", "0x7FC0", "sha256 of the file",
        "a step before", "the previous step's gradients", "re-run compile()",
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "rpcompile::opaque", "the older of the two buffers", "deadbeef", "4194304B",
        "slack for a loaded machine", "capture and cost are kept (not re-run)",
    ]
    def caught(text):
        return [n for n, p in PATTERNS.items() if p.search(text)]
    assert all(caught(t) for t in history), [t for t in history if not caught(t)]
    assert not any(caught(t) for t in honest), {t: caught(t) for t in honest if caught(t)}
