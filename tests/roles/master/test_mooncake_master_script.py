"""`mooncake_master` (mooncake/roles/master/upstream.py): upstream's gflags parsed and mapped
onto our config, and the real process serving upstream's admin queries on its metrics port
while a real store node mounts a segment and a real client puts a key."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mooncake.errors import ConfigError
from mooncake.roles.master.gflags import parse_duration_ms, parse_gflags
from mooncake.roles.master.upstream import FLAGS, plan_master

ROOT = Path(__file__).resolve().parents[3]
SECRET = "mooncake-master-script-test-secret"


def test_gflags_syntaxes() -> None:
    """--flag=value, --flag value, -flag, bare and negated booleans all parse as gflags does;
    a boolean never swallows the next word."""
    got = parse_gflags(
        [
            "--port",
            "6000",
            "-metrics_port=7000",
            "--enable_ha",
            "--noenable_http_metadata_server",
            "--eviction_ratio=0.1",
            "--default_kv_lease_ttl=2s",
            "--rpc_enable_tcp_no_delay",
            "--cluster_id",
            "x",
        ],
        FLAGS,
    )
    assert got == {
        "port": 6000,
        "metrics_port": 7000,
        "enable_ha": True,
        "enable_http_metadata_server": False,
        "eviction_ratio": 0.1,
        "default_kv_lease_ttl": 2000,
        "rpc_enable_tcp_no_delay": True,
        "cluster_id": "x",
    }
    assert parse_gflags(["--enable_ha=false", "--enable_ha=yes"], FLAGS) == {"enable_ha": True}


def test_durations_in_upstream_syntax() -> None:
    assert [parse_duration_ms(t) for t in ("500", "500ms", "2s", "1.5m", "1h")] == [
        500,
        500,
        2000,
        90_000,
        3_600_000,
    ]
    with pytest.raises(ValueError, match="duration"):
        parse_duration_ms("5 days")


def test_bad_command_lines_list_every_problem() -> None:
    """Unknown flags (with a suggestion), bad values and a missing argument are all named
    in one error."""
    with pytest.raises(ConfigError) as e:
        parse_gflags(["--prot=1", "--port=x", "--enable_ha=maybe", "--metrics_port"], FLAGS)
    text = str(e.value)
    assert "unknown command line flag 'prot'; did you mean --port?" in text
    assert "illegal value 'x' for flag 'port': expected an integer" in text
    assert "illegal value 'maybe' for flag 'enable_ha'" in text
    assert "flag 'metrics_port' is missing its argument" in text


def test_upstream_ci_command_line_maps_onto_our_config() -> None:
    """Upstream CI's command line: lease in ms, watermark, HTTP metadata server, port."""
    values = parse_gflags(
        [
            "--default_kv_lease_ttl=500",
            "--eviction_high_watermark_ratio=0.95",
            "--cluster_id=ci_test_cluster",
            "--port",
            "50051",
            "--enable_http_metadata_server=true",
        ],
        FLAGS,
    )
    plan = plan_master(values)
    o = plan.overrides
    assert o["cluster.master"] == "0.0.0.0:50051"
    assert o["store.lease_ttl_s"] == 0.5
    assert (o["store.high_watermark"], o["store.low_watermark"]) == (0.95, 0.9)
    assert (o["metrics.port"], o["metrics.host"]) == (9003, "0.0.0.0")
    assert o["api.host"] == "127.0.0.1"
    assert plan.metadata_server == ("0.0.0.0", 8080)
    assert "cluster.etcd" not in o  # cluster_id only names an HA cluster


def test_ha_flags_become_etcd_endpoints() -> None:
    values = parse_gflags(
        ["--enable_ha", "--etcd_endpoints=10.0.0.1:2379;https://e2:2379", "--cluster_id=ab_c"],
        FLAGS,
    )
    o = plan_master(values).overrides
    assert o["cluster.etcd"] == ["http://10.0.0.1:2379", "https://e2:2379"]
    assert o["cluster.name"] == "ab-c"
    with pytest.raises(ConfigError, match="--etcd_endpoints"):
        plan_master(parse_gflags(["--enable_ha"], FLAGS))
    with pytest.raises(ConfigError, match="only etcd"):
        plan_master(parse_gflags(["--enable_ha", "--ha_backend_type=redis"], FLAGS))


def test_flags_without_counterpart_are_refused_unless_default() -> None:
    """Default values of unsupported features pass; others are refused with the reason;
    tuning flags pass with a warning; rpc_port wins over port."""
    plan = plan_master(
        parse_gflags(
            ["--enable_offload=false", "--max_threads=2", "--rpc_port=6001", "--port=6000"],
            FLAGS,
        )
    )
    assert plan.overrides["cluster.master"] == "0.0.0.0:6001"
    assert plan.warnings == ["--max_threads: accepted; it has no effect on this master"]
    with pytest.raises(ConfigError) as e:
        plan_master(
            parse_gflags(
                [
                    "--enable_offload",
                    "--root_fs_dir=/x",
                    "--memory_allocator=cachelib",
                    "--eviction_ratio=0",
                ],
                FLAGS,
            )
        )
    text = str(e.value)
    assert "--enable_offload=True: not supported (only its default, False)" in text
    assert "--root_fs_dir=/x: not supported: a store node's SSD tier" in text
    assert "--memory_allocator=cachelib: only offset" in text
    assert "--eviction_ratio=0: our eviction" in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _script(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "mooncake.roles.master.upstream", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _env(secret: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    env["PYTHONPATH"] = str(ROOT)
    if secret is not None:
        env["MOONCAKE_CLUSTER_SECRET"] = secret
    return env


@pytest.mark.cluster
def test_refuses_to_start_without_the_cluster_secret() -> None:
    proc = _script(["--port", str(_free_port())], _env(None))
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "MOONCAKE_CLUSTER_SECRET" in err


@pytest.mark.cluster
def test_the_metadata_server_flag_serves_upstreams_protocol_beside_the_master() -> None:
    """--enable_http_metadata_server starts mooncake_http_metadata_server on its port: a
    PUT key reads back, a missing key is 404; SIGTERM to the master stops it too."""
    port = _free_port()
    args = ["--port", str(_free_port()), "--rpc_address", "127.0.0.1"]
    args += [f"--metrics_port={_free_port()}", "--metrics_host=127.0.0.1"]
    args += ["--enable_http_metadata_server", f"--http_metadata_server_port={port}"]
    proc = _script([*args, "--http_metadata_server_host=127.0.0.1"], _env(SECRET))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the ready handshake: the metadata server listens
        assert json.loads(line)["ready"] is True, line
        url = f"http://127.0.0.1:{port}/metadata?key=mooncake%2Frpc_meta%2Fa"
        put = urllib.request.Request(url, data=b'{"ip": "127.0.0.1"}', method="PUT")
        with urllib.request.urlopen(put, timeout=10) as r:
            assert r.status == 200
        assert _get(url)[0::2] == (200, '{"ip": "127.0.0.1"}')
        assert _get(url.replace("%2Fa", "%2Fb"))[0] == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


@dataclass
class RunningMaster:
    rpc: str  # host:port
    metrics: str  # base URL of the metrics port
    proc: subprocess.Popen[str]


@pytest.fixture
def master() -> Iterator[RunningMaster]:
    rpc_port, metrics_port = _free_port(), _free_port()
    proc = _script(
        [
            f"--port={rpc_port}",
            "--rpc_address",
            "127.0.0.1",
            f"--metrics_port={metrics_port}",
            "--metrics_host=127.0.0.1",
            "--default_kv_lease_ttl=200ms",
            "--eviction_ratio=0.1",
        ],
        _env(SECRET),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the ready handshake
        assert json.loads(line)["ready"] is True, line
        yield RunningMaster(f"127.0.0.1:{rpc_port}", f"http://127.0.0.1:{metrics_port}", proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        proc.communicate()


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


@pytest.mark.cluster
def test_admin_queries_see_a_real_segment_and_key(master: RunningMaster) -> None:
    """A store node's segment and a client's key show up in upstream's admin answers, in
    upstream's formats; unknown keys and segments get upstream's codes; SIGTERM exits 0."""
    from mooncake.store.client.client import Store
    from mooncake.store.node.node import StoreNode, TierSizes

    assert _get(master.metrics + "/get_all_segments") == (200, "text/plain; version=0.0.4", "")
    node = StoreNode(
        "s0", f"tcp://{master.rpc}", SECRET.encode(), TierSizes(dram_bytes=1 << 20), heartbeat_s=0.2
    )
    node.start()
    try:
        node.populated.wait(30)
        with Store.connect(f"tcp://{master.rpc}", SECRET, timeout_s=10) as store:
            store.put("k1", b"x" * 1000)
        status, _ctype, body = _get(master.metrics + "/get_all_segments")
        segments = body.splitlines()
        assert status == 200 and len(segments) == 1 and body.endswith("\n")
        name = segments[0]
        status, _c, body = _get(master.metrics + f"/query_segment?segment={name}")
        lines = body.splitlines()
        assert status == 200 and lines[0] == name
        assert lines[1].startswith("Used(bytes): ") and int(lines[1].split()[-1]) >= 1000
        assert lines[2] == "Capacity(bytes) : 1048576"
        detail = json.loads(_get(master.metrics + "/get_segments_detail")[2])
        assert detail["total_segments"] == 1
        assert detail["segments"][0]["segment_name"] == name
        assert detail["segments"][0]["size_bytes"] == 1 << 20
        assert _get(master.metrics + "/get_all_keys")[2] == "k1\n"
        status, ctype, body = _get(master.metrics + "/query_key?key=k1")
        replicas = json.loads(body)
        assert (status, ctype, replicas["success"]) == (
            200,
            "application/json; charset=utf-8",
            True,
        )
        assert [(r["size_"], r["segment_name"]) for r in replicas["data"]] == [(1000, name)]
        status, _c, body = _get(master.metrics + "/query_key?key=nope")
        assert status == 404 and json.loads(body)["error_code"] == -704
        batch = json.loads(_get(master.metrics + "/batch_query_keys?keys=k1,nope")[2])["data"]
        assert batch["k1"]["ok"] is True and batch["nope"] == {
            "ok": False,
            "error": "OBJECT_NOT_FOUND",
        }
        assert _get(master.metrics + "/query_segment?segment=nope")[0] == 404
        health = json.loads(_get(master.metrics + "/health")[2])
        assert health == {
            "status": "ok",
            "role": "leader",
            "ha_state": "leader",
            "service_ready": True,
        }
        assert "mooncake_store" in _get(master.metrics + "/metrics")[2]
        assert _get(master.metrics + "/nothing")[0] == 404
    finally:
        node.stop()
    deadline = time.monotonic() + 30
    while _get(master.metrics + "/get_all_segments")[2]:  # the node unmounted on stop
        assert time.monotonic() < deadline
        time.sleep(0.05)
    master.proc.send_signal(signal.SIGTERM)
    assert master.proc.wait(timeout=30) == 0
