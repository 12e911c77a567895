"""scripts/upstream-tests (mooncake/integrations/upstreamtests.py) end to end: our real
mooncake_master started, a checkout's test file run by pytest with upstream's variables set,
each test's outcome read back from the JUnit report."""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import pytest

from mooncake.integrations.upstreamtests import main

TEST_FILE = """
import os, socket, unittest

class TestAgainstMaster(unittest.TestCase):
    def test_master_answers(self):
        host, port = os.environ["MASTER_SERVER"].split(":")
        socket.create_connection((host, int(port)), timeout=5).close()
        self.assertEqual(os.environ["DEFAULT_KV_LEASE_TTL"], "500")
        # upstream's run_tests.sh: an HTTP metadata server, LOCAL_HOSTNAME left to the tests
        meta = os.environ["MC_METADATA_SERVER"]
        self.assertRegex(meta, r"^http://127[.]0[.]0[.]1:[0-9]+/metadata$")
        socket.create_connection(("127.0.0.1", int(meta.split(":")[2].split("/")[0])), 5).close()
        self.assertNotIn("LOCAL_HOSTNAME", os.environ)
        import mooncake
        self.assertTrue(mooncake.__file__.startswith(os.environ["PYTHONPATH"]))

    def test_fails(self):
        self.assertEqual(1, 2, "one is not two")

    @unittest.skip("not here")
    def test_skipped(self):
        pass
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.cluster
def test_outcomes_per_test_against_our_master(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tests = tmp_path / "mooncake-wheel" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_x.py").write_text(TEST_FILE)
    (tests / "conftest.py").write_text("raise RuntimeError('upstream conftest must not load')\n")
    files = ["test_x.py", "test_absent.py", "broken.py", "test_http_metadata_server.py"]
    (tests / "broken.py").write_text("import no_such_module_here\n")
    # upstream's own aiohttp server's test: not ours; skipped where aiohttp is missing
    (tests / "test_http_metadata_server.py").write_text("import aiohttp\n")
    rc = main([str(tmp_path), "--files", *files, "--master-port", str(_free_port()), "--json"])
    report = json.loads(capsys.readouterr().out)
    got = {(t["file"], t["test"]): (t["outcome"], t["message"]) for t in report["tests"]}
    assert got[("test_x.py", "TestAgainstMaster.test_master_answers")] == ("passed", "")
    outcome, message = got[("test_x.py", "TestAgainstMaster.test_fails")]
    assert outcome == "failed" and "one is not two" in message
    assert got[("test_x.py", "TestAgainstMaster.test_skipped")] == ("skipped", "not here")
    assert got[("test_absent.py", "-")] == ("error", "no such file in this checkout")
    [broken] = [t for t in report["tests"] if t["file"] == "broken.py"]
    assert broken["outcome"] == "error" and "no_such_module_here" in broken["message"]
    [meta] = [t for t in report["tests"] if t["file"] == "test_http_metadata_server.py"]
    has_aiohttp = importlib.util.find_spec("aiohttp") is not None
    if not has_aiohttp:
        assert meta["outcome"] == "skipped" and "upstream's own" in meta["message"]
    skipped = 1 + (not has_aiohttp)
    assert report["summary"] == {
        "passed": 1,
        "failed": 1,
        "error": 2 + has_aiohttp,
        "skipped": skipped,
    }
    assert rc == 1


def test_a_folder_without_upstreams_tests_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no mooncake-wheel/tests here"):
        main([str(tmp_path)])
