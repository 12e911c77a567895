"""docs/structure.md keeps one line per module: a new module without its line fails here."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_has_a_line_in_structure_md():
    text = (ROOT / "docs" / "structure.md").read_text()
    missing = []
    for path in sorted((ROOT / "mooncake").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" and path.stat().st_size == 0:
            continue
        if f"`{rel}`" not in text:
            missing.append(rel)
    assert not missing, f"add a line for each to docs/structure.md: {missing}"


def test_structure_md_names_no_missing_module():
    text = (ROOT / "docs" / "structure.md").read_text()
    stale = [
        path for path in re.findall(r"`(mooncake/[\w/]+\.py)`", text) if not (ROOT / path).exists()
    ]
    assert not stale, f"docs/structure.md names modules that do not exist: {stale}"
