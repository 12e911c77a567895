"""`mooncake config check|show|example` through the real typer app."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mooncake.cli.app import app, load_verbs
from mooncake.conductor.roofline import roofline_cost_model
from mooncake.config.doc import ALL_FIELDS, FIELDS

EXAMPLE = Path(__file__).resolve().parents[2] / "mooncake.toml.example"


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    load_verbs()
    return CliRunner()


def test_check_ok_exits_0(runner: CliRunner) -> None:
    result = runner.invoke(app, ["config", "check", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"{EXAMPLE}: ok"


def test_check_prints_every_problem_and_exits_2(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[store]\nreplicas = "two"\n[scheduler]\npolicy = "fifo"\n')
    result = runner.invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert lines[0] == f"{path}: 2 problems"
    assert lines[1].startswith('store.replicas: expected an integer >= 1, got "two"')
    assert lines[2].startswith("scheduler.policy: expected one of random,")
    assert "Traceback" not in result.output


def test_check_honours_environment_and_set(runner: CliRunner) -> None:
    bad_env = runner.invoke(
        app, ["config", "check", str(EXAMPLE)], env={"MOONCAKE_STORE_REPLICAS": "0"}
    )
    assert bad_env.exit_code == 2 and "(from MOONCAKE_STORE_REPLICAS)" in bad_env.output
    bad_set = runner.invoke(app, ["config", "check", str(EXAMPLE), "--set", "api.port=0"])
    assert bad_set.exit_code == 2 and "api.port: expected an integer in 1..65535" in bad_set.output


def test_show_json_has_every_key_with_value_and_source(runner: CliRunner) -> None:
    args = ["config", "show", str(EXAMPLE), "--json", "--set", "store.replicas=2"]
    env = {"MOONCAKE_STORE_SSD_BYTES": "1GiB", "MOONCAKE_STORE_SSD_PATH": "/ssd"}
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {s: set(keys) for s, keys in data.items()} == {s: set(k) for s, k in FIELDS.items()}
    assert data["store"]["replicas"] == {"value": 2, "source": "flag"}
    assert data["store"]["ssd_bytes"] == {
        "value": "1GiB",
        "bytes": 1 << 30,
        "source": "env:MOONCAKE_STORE_SSD_BYTES",
    }
    assert data["store"]["dram_bytes"] == {"value": "50%", "source": f"file:{EXAMPLE}"}
    assert data["transfer"]["slice_bytes"]["bytes"] == 65536


def test_show_hides_secrets(runner: CliRunner) -> None:
    env = {"MOONCAKE_CLUSTER_SECRET": "x" * 20, "MOONCAKE_API_API_KEYS": "k1secret,k2secret"}
    as_json = runner.invoke(app, ["config", "show", "--json"], env=env)
    table = runner.invoke(app, ["config", "show"], env=env)
    for result in (as_json, table):
        assert result.exit_code == 0, result.output
        assert "x" * 20 not in result.output and "k1secret" not in result.output
    assert json.loads(as_json.output)["api"]["api_keys"]["value"] == ["<hidden>", "<hidden>"]


def test_show_table_lists_every_key(runner: CliRunner) -> None:
    result = runner.invoke(app, ["config", "show", "--doc"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert all(key in result.output for key in ALL_FIELDS)


def test_show_invalid_config_exits_2(runner: CliRunner) -> None:
    result = runner.invoke(app, ["config", "show", "--set", "stor.replicas=1"])
    assert result.exit_code == 2 and "did you mean [store]?" in result.output


def test_example_command_prints_the_example_file(runner: CliRunner) -> None:
    result = runner.invoke(app, ["config", "example"])
    assert result.exit_code == 0 and result.output == EXAMPLE.read_text()


def test_check_refuses_what_would_stop_the_master(runner: CliRunner, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.json"
    result = runner.invoke(
        app, ["config", "check", str(EXAMPLE), "--set", f"scheduler.cost_model_path={missing}"]
    )
    assert result.exit_code == 2
    assert f"scheduler.cost_model_path: cannot read cost model {missing}" in result.output
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    args = ["config", "check", str(EXAMPLE), "--set", f"scheduler.cost_model_path={garbled}"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "scheduler.cost_model_path: cost model" in result.output
    other = tmp_path / "other-model.json"  # a profile of another model than model.path's
    roofline_cost_model("llama3-8b", "A800").save(other)
    result = runner.invoke(
        app, ["config", "check", str(EXAMPLE), "--set", f"scheduler.cost_model_path={other}"]
    )
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "is a cost model of 'llama3-8b', but model.path serves 'dummy:tiny'" in said
    assert "`mooncake profile`" in said
    result = runner.invoke(app, ["config", "check", str(EXAMPLE), "--set", "model.path=dummy:x"])
    assert result.exit_code == 2 and "model.path: unknown model 'dummy:x'" in result.output
    # a prefill node does not read the master's cost model file: not its problem
    args += ["--set", "node.role=prefill"]
    assert runner.invoke(app, args).exit_code == 0


def test_the_readme_config_commands_run_as_written(runner: CliRunner) -> None:
    """Every `mooncake config check ...` the README shows runs (FILE: the example file)."""
    import re
    import shlex

    readme = (EXAMPLE.parent / "README.md").read_text()
    commands = re.findall(r"`mooncake (config check [^`]*)`", readme)
    assert commands
    for command in commands:
        args = [str(EXAMPLE) if a == "FILE" else a for a in shlex.split(command)]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (command, result.output)
