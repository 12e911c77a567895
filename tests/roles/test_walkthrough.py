"""README's "Deploying on N machines", followed as written on one host: five TOML files
(master, two prefill nodes forming one group, a decode node, a store node), each node
started with `mooncake up --config FILE`, no cost model configured."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mooncake.local.launcher import free_port
from mooncake.local.supervisor import Child, wait_ready

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

SHARED = """
[cluster]
name = "walk"
master = "127.0.0.1:{master_port}"
secret = "{secret}"

[model]
path = "dummy:tiny"
block_tokens = 32

[prefill]
pipeline_group_size = 2
chunk_tokens = 256

[store]
dram_bytes = "64MiB"
"""

ROLE = {  # one file per node: the shared part, then what only this node says
    "master": '[node]\nrole = "master"\n\n[api]\nhost = "127.0.0.1"\nport = {api_port}\n\n'
    "[metrics]\nenabled = false\n",
    "store-0": '[node]\nrole = "store"\nid = "store-0"\n',
    "prefill-0": '[node]\nrole = "prefill"\nid = "prefill-0"\n',
    "prefill-1": '[node]\nrole = "prefill"\nid = "prefill-1"\n',
    "decode-0": '[node]\nrole = "decode"\nid = "decode-0"\n\n[decode]\nkv_cache_bytes = "64MiB"\n',
}


def _write_configs(tmp: Path) -> tuple[dict[str, Path], str]:
    values = {"master_port": free_port(), "api_port": free_port(), "secret": secrets.token_hex(16)}
    paths = {}
    for name, role_part in ROLE.items():
        paths[name] = tmp / f"{name}.toml"
        paths[name].write_text(SHARED.format(**values) + "\n" + role_part.format(**values))
        paths[name].chmod(0o600)
    return paths, f"http://127.0.0.1:{values['api_port']}"


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("walkthrough")
    paths, url = _write_configs(tmp)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    children: list[Child] = []
    try:
        for name, path in paths.items():  # the master first, as the walkthrough says
            cmd = [sys.executable, "-m", "mooncake", "up", "--config", str(path)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
            children.append(Child(name, name, proc))
        for child in children:
            wait_ready(child, 120)
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, httpx.get(url + "/health", timeout=5).text
            time.sleep(0.2)
        yield url
    finally:
        for child in reversed(children):
            child.proc.send_signal(signal.SIGTERM)
        for child in reversed(children):
            try:
                child.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()


def test_the_walkthrough_serves_and_reuses_a_repeated_prompt(deployed: str) -> None:
    """No cost model configured: the master prices with its roofline; a repeated long
    prompt reuses its KV from the pool."""
    prompt = [(i * 31 + 7) % 250 + 1 for i in range(700)]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    first = httpx.post(deployed + "/v1/completions", json=body, timeout=60)
    assert first.status_code == 200, first.text
    deadline = time.monotonic() + 15
    while True:
        again = httpx.post(deployed + "/v1/completions", json=body, timeout=60)
        assert again.status_code == 200, again.text
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert cached >= 640
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
