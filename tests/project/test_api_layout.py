"""docs/layout.md's block names every module and folder of the package as it is."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _layout_block() -> str:
    text = (ROOT / "docs" / "layout.md").read_text()
    section = text[text.index("# Layout"):]
    return section[section.index("```\n") + 4:section.index("\n```", section.index("```\n") + 4)]


def test_the_layout_page_names_every_module():
    block = _layout_block()
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", block))
    pkg = ROOT / "rpcompile"
    missing = []
    for path in sorted(pkg.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        if path.stem not in words:
            missing.append(str(path.relative_to(ROOT)))
    folders = {p.parent.relative_to(pkg).parts[0] for p in pkg.rglob("*.py")
               if p.parent != pkg and p.parent.name != "__pycache__"}
    missing += [f"rpcompile/{f}/" for f in sorted(folders) if f"{f}/" not in block]
    missing += [str(p.relative_to(ROOT)) for p in sorted(pkg.rglob("configs/*.json"))
                if "configs/" not in block]
    assert not missing, f"docs/layout.md does not name: {missing}"
