"""The manual and the CLI share one source: the committed page is what the CLI renders."""

import subprocess
import sys
from pathlib import Path

import pytest

from mooncake.cli.manpage import build_click_app, iter_commands, render

MAN_PAGE = Path(__file__).resolve().parents[2] / "man" / "mooncake.1"


def test_committed_man_page_matches_the_cli():
    expected = render(build_click_app())
    assert MAN_PAGE.read_text() == expected, (
        "man/mooncake.1 is stale: run `python -m mooncake.cli.manpage > man/mooncake.1`"
    )


def test_every_command_and_option_is_in_the_man_page():
    page = MAN_PAGE.read_text()
    root = build_click_app()
    commands = iter_commands(root)
    assert any(path == ("bench", "hash") for path, _ in commands)
    for path, command in commands:
        assert f'.SS "mooncake {" ".join(path)}"' in page, path
        for param in command.params:
            for opt in param.opts:
                if opt.startswith("-") and opt not in ("--help", "-h"):
                    assert opt.replace("-", "\\-") in page, (path, opt)


@pytest.mark.cluster
def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "mooncake", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("mooncake ")
