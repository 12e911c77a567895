"""The banner `mooncake up --local` prints once its cluster serves: the curl line pastes as
one command however narrow the console, and the next commands name a program that runs."""

from __future__ import annotations

import io
import json
import os
import shlex
import sys
from pathlib import Path

import pytest
from rich.console import Console

from mooncake.cli.up import command_name, print_ready
from mooncake.local.launcher import LocalPlan
from mooncake.local.runfile import LocalCluster
from mooncake.local.supervisor import RestartPolicy


def _banner(tmp_path: Path, width: int, api_key: str = "", model: str = "dummy:tiny") -> list[str]:
    out = Console(file=io.StringIO(), width=width)
    info = LocalCluster(
        url="http://127.0.0.1:8000",
        master="127.0.0.1:5000",
        config_path="",
        pids={},
        api_key=api_key,
    )
    plan = LocalPlan(run_dir=tmp_path, model=model)
    print_ready(out, plan, info, RestartPolicy(), "", tmp_path / "rf")
    return out.file.getvalue().splitlines()  # type: ignore[attr-defined]


@pytest.mark.parametrize("api_key", ["", "k1"])
def test_the_curl_line_is_one_intact_command_on_a_narrow_console(
    tmp_path: Path, api_key: str
) -> None:
    lines = _banner(tmp_path, 40, api_key)
    (curl,) = [line for line in lines if line.startswith("  try: curl")]
    words = shlex.split(curl.removeprefix("  try: "))
    assert words[:2] == ["curl", "http://127.0.0.1:8000/v1/completions"]
    assert words[-2:] == ["-d", '{"model": "dummy:tiny", "prompt": "Hello", "max_tokens": 16}']
    assert ("Authorization: Bearer KEY" in words) == bool(api_key)


def test_the_banner_names_the_program_that_started_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/run starts .venv/bin/mooncake, which is not on PATH: the banner says so."""
    monkeypatch.setattr(sys, "argv", [".venv/bin/mooncake", "up", "--local"])
    monkeypatch.setenv("PATH", "/nonexistent")
    lines = _banner(tmp_path, 40)
    assert (
        "  watch: .venv/bin/mooncake status    load: .venv/bin/mooncake replay TRACE    "
        "stop: Ctrl-C" in lines
    )


def test_command_name_is_mooncake_only_when_path_finds_this_program(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    program = tmp_path / "bin" / "mooncake"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.setattr(sys, "argv", [str(program), "up"])
    monkeypatch.setenv("PATH", str(program.parent))
    assert command_name() == "mooncake"
    monkeypatch.setenv("PATH", os.devnull)
    assert command_name() == str(program)
    monkeypatch.setattr(sys, "argv", ["/x/mooncake/__main__.py", "up"])
    assert command_name() == f"{sys.executable} -m mooncake"


def test_a_chat_model_gets_a_chat_question_to_paste(tmp_path: Path):
    """A real model's banner asks it a question through its chat template."""
    lines = _banner(tmp_path, 60, model="smollm2-135m-instruct")
    (curl,) = [line for line in lines if line.startswith("  try: curl")]
    words = shlex.split(curl.removeprefix("  try: "))
    assert words[1] == "http://127.0.0.1:8000/v1/chat/completions"
    body = json.loads(words[-1])
    assert body["model"] == "smollm2-135m-instruct"
    assert body["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
