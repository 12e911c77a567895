"""The vLLM connector's settings: the pool from a mooncake TOML file named in
`kv_connector_extra_config`, refusals that name the key, and block layouts the pool
stores. No vLLM needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncake.errors import ConfigError
from mooncake.integrations.vllm.settings import kv_layout, load_settings, vllm_fingerprint


def test_the_pool_comes_from_the_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.toml"
    path.write_text(
        '[cluster]\nmaster = "127.0.0.1:7100"\nsecret = "abcdefghijklmnopqrstuvwxyz"\n'
        "store_call_timeout_s = 3.5\n[store]\nreplicas = 2\n"
    )
    s = load_settings({"config": str(path)})
    assert s.master == "tcp://127.0.0.1:7100" and s.secret == b"abcdefghijklmnopqrstuvwxyz"
    assert s.timeout_s == 3.5 and s.replicas == 2 and s.host == "127.0.0.1"


def test_an_unknown_key_or_a_pool_without_a_secret_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown keys \['confg'\]; allowed: \['config'\]"):
        load_settings({"confg": "x.toml"})
    path = tmp_path / "mooncake.toml"
    path.write_text('[cluster]\nmaster = "127.0.0.1:7100"\n')
    with pytest.raises(ConfigError, match="cluster.secret"):
        load_settings({"config": str(path)})


def test_layouts_and_fingerprints() -> None:
    lay = kv_layout(2, 32, 2, 64, "bfloat16")
    assert lay.layer_bytes == 2 * 32 * 2 * 64 * 2
    with pytest.raises(ConfigError, match="'fp8' is not supported"):
        kv_layout(2, 32, 2, 64, "fp8")
    # a model path or device of its own: blocks never shared
    assert vllm_fingerprint("m", "cpu", lay) != vllm_fingerprint("m", "cuda", lay)
    assert vllm_fingerprint("m", "cpu", lay) != vllm_fingerprint("n", "cpu", lay)
