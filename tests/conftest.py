"""Tests grouped by the hardware they need: `gpu` (a CUDA GPU through torch) and `rdma`
(an RDMA device with an ACTIVE port, and pyverbs). Without it they are skipped with the
reason; `scripts/hwtest` runs them on a GPU+RDMA node.

A test that starts a process (a cluster, a node, a child interpreter), itself or through a
fixture, carries the `cluster` marker, so `pytest -m "not cluster"` is the fast inner loop;
a test that starts one without the marker fails here, naming it.

Every test runs with its own run directory (`private_run_dir`), never the user's."""

from __future__ import annotations

import functools
import multiprocessing.process
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """XDG_RUNTIME_DIR for the whole session (and every process a test starts): a directory
    of this run, so the run directory `$XDG_RUNTIME_DIR/mooncake-<uid>` is never the user's
    (their cluster's runfile, config with its secret, ssd/ and state/). It is kept on disk:
    on a tmpfs the local cluster's SSD tier would go to the user's /var/tmp/mooncake-<uid>."""
    from mooncake.hw.ssdplace import MEMORY_FILESYSTEMS, fstype_of

    base = tmp_path_factory.mktemp("xdg-runtime")
    on_disk = None
    if fstype_of(str(base)) in MEMORY_FILESYSTEMS:
        base = on_disk = Path(tempfile.mkdtemp(prefix="mooncake-tests-", dir="/var/tmp"))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("XDG_RUNTIME_DIR", str(base))
            yield base
    finally:
        if on_disk is not None:
            shutil.rmtree(on_disk, ignore_errors=True)


@functools.cache
def missing_gpu() -> str:
    """Why no test marked `gpu` can run here ("" when one can)."""
    import torch

    if not torch.cuda.is_available():
        return f"needs a CUDA GPU (torch {torch.__version__} sees none): run scripts/hwtest"
    return ""


@functools.cache
def missing_rdma() -> str:
    """Why no test marked `rdma` can run here ("" when one can)."""
    from mooncake.native import sysfs, verbs_info

    nics = sysfs.read_rdma_nics(Path("/sys")) or []
    if not any(n.is_active for n in nics):
        found = ", ".join(n.name for n in nics) or "none in /sys/class/infiniband"
        return f"needs an RDMA device with an ACTIVE port (found: {found}): scripts/hwtest"
    if not verbs_info.read_verbs_devices(None).is_installed:
        return "needs pyverbs (apt install python3-pyverbs)"
    return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker, why in (("gpu", missing_gpu), ("rdma", missing_rdma)):
            if item.get_closest_marker(marker) is not None and (reason := why()):
                item.add_marker(pytest.mark.skip(reason=reason))


# What is running now (the test, the fixture being set up), the fixtures seen starting a
# process, and the unmarked tests that started one.
_running: dict[str, Any] = {"item": None, "fixture": None}
_spawning_fixtures: set[tuple[str, str]] = set()  # (where it is defined, its name)
_unmarked_spawners: set[str] = set()


# Frames of the machinery between a caller and the process it starts.
_PLUMBING = (
    "subprocess.py",
    "threading.py",
    "/asyncio/",
    "/multiprocessing/",
    "/concurrent/futures/",
)
_OURS = (str(Path(__file__).resolve().parents[1] / "mooncake"), str(Path(__file__).parent))


def _started_by_us() -> bool:
    """Whether the process being started was asked for by our code: the first frame past
    the machinery is ours, or there is none (a worker thread running `Popen` itself, as
    the local launcher's does). A library's own helper process, such as
    ctypes.util.find_library's ldconfig, is not a cluster."""
    frame = sys._getframe(3)  # past this, _note_process_start and the wrapper
    while frame is not None and any(p in frame.f_code.co_filename for p in _PLUMBING):
        frame = frame.f_back
    return frame is None or frame.f_code.co_filename.startswith(_OURS)


def _note_process_start() -> None:
    if not _started_by_us():
        return
    if (fixture := _running["fixture"]) is not None:
        _spawning_fixtures.add(fixture)
    item = _running["item"]
    if item is not None and item.get_closest_marker("cluster") is None:
        _unmarked_spawners.add(item.nodeid)


def _noting(start: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(start)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _note_process_start()
        return start(*args, **kwargs)

    return wrapper


# NOTE: asyncio's subprocesses and subprocess.run go through Popen
subprocess.Popen.__init__ = _noting(subprocess.Popen.__init__)  # type: ignore[method-assign]
multiprocessing.process.BaseProcess.start = _noting(  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start
)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    # NOTE: by definition, not name: fixtures of one name in two modules are two fixtures
    outer, _running["fixture"] = _running["fixture"], (fixturedef.baseid, fixturedef.argname)
    try:
        yield
    finally:
        _running["fixture"] = outer


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _running["item"] = item
    try:
        yield
    finally:
        _running["item"] = None


@pytest.fixture(autouse=True)
def _cluster_marker_checked(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test without the `cluster` marker that started a process, or used a fixture
    that did."""
    yield
    item = request.node
    if item.get_closest_marker("cluster") is not None:
        return
    defs = item._fixtureinfo.name2fixturedefs  # the closure's definitions, the last applies
    used = {(d[-1].baseid, d[-1].argname) for d in defs.values() if d}
    through = sorted(name for _, name in used & _spawning_fixtures)
    if item.nodeid in _unmarked_spawners or through:
        how = f" through fixture {', '.join(through)}" if through else ""
        pytest.fail(
            f"{item.nodeid} starts a process{how}: mark it `@pytest.mark.cluster` "
            "(or `pytestmark = pytest.mark.cluster` for the whole file)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def cost_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One profiled cost model for every local cluster of the session (tests/roles, tests/local)."""
    return tmp_path_factory.mktemp("costmodel")
