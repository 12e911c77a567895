"""The local cluster's run directory cannot be hijacked (another user's, a symlink, one
others may write in), its files are written without following symlinks, and a runfile
whose master pid now belongs to another process is not taken for a running cluster."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake.errors import MooncakeError
from mooncake.local.config import write_config
from mooncake.local.launcher import LocalPlan
from mooncake.local.runfile import LocalCluster, read_runfile, runfile_path, write_runfile

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


@pytest.fixture
def other_process() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that is not a mooncake node (as one reusing a dead master's pid)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def _cluster(pid: int) -> LocalCluster:
    return LocalCluster(
        url="http://127.0.0.1:1", master="127.0.0.1:2", config_path="/x.toml", pids={"master": pid}
    )


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_runfile_is_private_and_not_written_into_a_dir_others_may_write(
    runtime_dir: Path,
) -> None:
    path = write_runfile(_cluster(os.getpid()))
    assert path == runfile_path()
    assert (_mode(path.parent), _mode(path)) == (0o700, 0o600)

    path.unlink()
    path.parent.chmod(0o777)  # as another local user could have made it
    with pytest.raises(MooncakeError, match=r"others may write in it .*chmod go-w") as e:
        write_runfile(_cluster(os.getpid()))
    assert str(path.parent) in str(e.value)
    assert not path.exists()
    with pytest.raises(MooncakeError, match="others may write in it"):
        read_runfile()  # nor is a runfile someone else may have put there trusted


def test_a_run_dir_that_is_a_symlink_or_not_ours_is_refused(
    runtime_dir: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    runtime_dir.mkdir()
    runfile_path().parent.symlink_to(elsewhere)
    with pytest.raises(MooncakeError, match=r"symbolic link.*--run-dir"):
        write_runfile(_cluster(os.getpid()))
    assert list(elsewhere.iterdir()) == []

    runfile_path().parent.unlink()
    if os.getuid() == 0:
        runfile_path().parent.mkdir(mode=0o700)
        os.chown(runfile_path().parent, 65534, 65534)  # nobody's
        theirs = runfile_path().parent
    else:
        theirs = Path("/")  # root's
    with pytest.raises(MooncakeError, match=r"belongs to uid \d+, not to you") as e:
        write_runfile(_cluster(os.getpid()), theirs / "local.json")
    assert str(theirs) in str(e.value)


def test_the_generated_config_is_never_written_through_a_symlink(tmp_path: Path) -> None:
    """The config holds the secret: a symlink planted at its path (to a file the attacker
    can read, or one to clobber) is replaced, not followed."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    config = run_dir / "mooncake-local.toml"
    config.symlink_to(victim)
    write_config(LocalPlan(run_dir=run_dir), config, "s" * 32, 5000, "")
    assert victim.read_text() == "keep me"
    assert not config.is_symlink() and "s" * 32 in config.read_text()
    assert _mode(config) == 0o600


@pytest.mark.cluster
def test_a_runfile_whose_master_pid_now_belongs_to_another_process_is_stale(
    other_process: subprocess.Popen[bytes],
) -> None:
    """The pid is alive but its start time (or, in a runfile without start times, its
    command line) is not the master's: the cluster is gone, nothing blocks a new one."""
    path = write_runfile(_cluster(other_process.pid))
    assert read_runfile() is not None  # the process recorded is the one alive
    data = json.loads(path.read_bytes())
    data["start_ticks"]["master"] -= 1  # recorded: an earlier process with that pid
    path.write_text(json.dumps(data))
    assert read_runfile() is None
    del data["start_ticks"]  # a runfile without start times: not a mooncake command line
    path.write_text(json.dumps(data))
    assert read_runfile() is None
