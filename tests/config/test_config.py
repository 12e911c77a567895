"""mooncake.config.settings: defaults, the example file, layering, every kind of error, sizes."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from mooncake.config.doc import ALL_FIELDS, FIELDS, render_example
from mooncake.config.load import load_config, parse_set_option
from mooncake.config.portrange import PortRange, node_ports
from mooncake.config.settings import Config, StoreConfig, TransferConfig
from mooncake.config.sizes import Size, parse_size
from mooncake.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "mooncake.toml.example"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mooncake.toml"
    path.write_text(text)
    return path


def errors_of(tmp_path: Path, text: str, **kw: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env=kw.pop("env", {}), **kw)  # type: ignore[arg-type]
    return info.value.errors


# --- defaults and the example file -------------------------------------------------------


def test_defaults_are_the_documented_values() -> None:
    c = Config()
    assert (c.cluster.name, c.cluster.master, c.cluster.secret) == (
        "mooncake",
        "127.0.0.1:50051",
        "",
    )
    assert c.node.role == "master"
    assert c.store.dram_bytes == Size(fraction=0.5) and c.store.vram_bytes.is_zero
    assert (c.store.replicas, c.store.high_watermark, c.store.low_watermark) == (1, 0.95, 0.85)
    assert c.transfer.slice_bytes == 64 * 1024 and c.transfer.nics == ()
    assert (c.model.path, c.model.block_tokens, c.prefill.pipeline_group_size) == (
        "dummy:tiny",
        512,
        1,
    )
    assert (c.scheduler.policy, c.scheduler.rejection) == ("kvcache_centric", "predictive")
    assert (c.api.port, c.metrics.port, c.metrics.enabled) == (8000, 9400, True)


def test_empty_file_and_no_file_give_defaults_with_default_sources(tmp_path: Path) -> None:
    for path in (None, write(tmp_path, "")):
        loaded = load_config(path, env={})
        assert loaded.config == Config()
        assert set(loaded.sources) == set(ALL_FIELDS)
        assert set(loaded.sources.values()) == {"default"}


def test_example_parses_to_exactly_the_defaults() -> None:
    loaded = load_config(EXAMPLE, env={})
    assert loaded.config == Config()
    assert set(loaded.sources.values()) == {f"file:{EXAMPLE}"}


def test_example_file_is_the_generated_one() -> None:
    """Regenerate with `mooncake config example > mooncake.toml.example`."""
    assert EXAMPLE.read_text() == render_example()


def test_every_key_appears_in_the_example_with_a_comment_right_above() -> None:
    lines = EXAMPLE.read_text().splitlines()
    section = None
    documented = set()
    for i, line in enumerate(lines):
        if line.startswith("["):
            section = line.strip("[]")
        elif line and not line.startswith("#"):
            assert lines[i - 1].startswith("# "), f"no comment above {line!r}"
            documented.add(f"{section}.{line.split(' = ')[0]}")
    assert documented == set(ALL_FIELDS)


def test_example_has_no_unknown_key_or_section() -> None:
    data = tomllib.loads(EXAMPLE.read_text())
    assert set(data) == set(FIELDS)
    for section, table in data.items():
        assert set(table) == set(FIELDS[section])


def test_every_field_has_a_doc() -> None:
    assert all(spec.doc for spec in ALL_FIELDS.values())


# --- layering ------------------------------------------------------------------------------


def test_precedence_default_file_env_flag_with_sources(tmp_path: Path) -> None:
    path = write(tmp_path, "[store]\nreplicas = 2\nlease_ttl_s = 7\n[api]\nport = 8100\n")
    env = {"MOONCAKE_STORE_REPLICAS": "3", "MOONCAKE_API_PORT": "8200"}
    loaded = load_config(path, env=env, overrides={"store.replicas": 4})
    c, src = loaded.config, loaded.sources
    assert (c.store.replicas, src["store.replicas"]) == (4, "flag")
    assert (c.api.port, src["api.port"]) == (8200, "env:MOONCAKE_API_PORT")
    assert (c.store.lease_ttl_s, src["store.lease_ttl_s"]) == (7.0, f"file:{path}")
    assert (c.store.heartbeat_ttl_s, src["store.heartbeat_ttl_s"]) == (10.0, "default")


def test_env_strings_convert_by_field_type() -> None:
    env = {
        "MOONCAKE_API_API_KEYS": "a, b,,c",
        "MOONCAKE_METRICS_ENABLED": "no",
        "MOONCAKE_SCHEDULER_TTFT_SLO_S": "2.5",
        "MOONCAKE_STORE_DRAM_BYTES": "64GiB",
        "MOONCAKE_STORE_VRAM_BYTES": "80%",
        "MOONCAKE_TRANSFER_SLICE_BYTES": "1MiB",
        "MOONCAKE_TRANSFER_NICS": "",
        "MOONCAKE_LOG_LEVEL": "debug",  # not a section: ignored
        "MOONCAKE_CONFIG": "/nowhere",
    }
    c = load_config(env=env).config
    assert c.api.api_keys == ("a", "b", "c") and c.metrics.enabled is False
    assert c.scheduler.ttft_slo_s == 2.5 and c.transfer.nics == ()
    assert c.store.dram_bytes == Size(num_bytes=64 << 30) and c.store.vram_bytes.fraction == 0.8
    assert c.transfer.slice_bytes == 1 << 20


@pytest.mark.parametrize("text,value", [("true", True), ("1", True), ("YES", True), ("0", False)])
def test_env_bool_spellings(text: str, value: bool) -> None:
    assert load_config(env={"MOONCAKE_METRICS_ENABLED": text}).config.metrics.enabled is value


def test_overrides_accept_typed_and_string_values() -> None:
    overrides = {"store.replicas": "2", "transfer.nics": ["mlx5_0"], "store.ssd_bytes": 0}
    c = load_config(env={}, overrides=overrides).config
    assert (c.store.replicas, c.transfer.nics, c.store.ssd_bytes) == (2, ("mlx5_0",), Size())


def test_parse_set_option() -> None:
    assert parse_set_option("store.replicas=2") == ("store.replicas", "2")
    assert parse_set_option("api.api_keys=a=b,c") == ("api.api_keys", "a=b,c")
    for bad in ("store.replicas", "replicas=2", "a.b.c=1"):
        with pytest.raises(ConfigError, match="SECTION.KEY=VALUE"):
            parse_set_option(bad)


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,message",
    [
        ("[store]\nbogus = 1", "store.bogus: unknown key (known keys in [store]: vram_bytes,"),
        ("[store]\nreplica = 1", "did you mean replicas?"),
        ("[stor]\nreplicas = 1", "[stor]: unknown section (known: cluster, node,"),
        ("[stor]\nreplicas = 1", "did you mean [store]?"),
        ("replicas = 1", "replicas: a key outside any section; put it under [store]"),
        ('[store]\nreplicas = "two"', 'store.replicas: expected an integer >= 1, got "two"'),
        ("[store]\nreplicas = 0", "store.replicas: expected an integer >= 1, got 0"),
        ("[store]\nreplicas = true", "store.replicas: expected an integer >= 1, got true"),
        ('[store]\nreplicas = "2"', 'got "2" (a quoted string; write it without quotes)'),
        ('[transfer]\nnics = "mlx5_0"', 'write a TOML list, e.g. ["a", "b"]'),
        ("[api]\nport = 70000", "api.port: expected an integer in 1..65535, got 70000"),
        ("[store]\nhigh_watermark = 1.5", "store.high_watermark: expected a number in (0, 1]"),
        (
            '[scheduler]\npolicy = "fifo"',
            "scheduler.policy: expected one of random, round_robin, load_balance, "
            'cache_aware, kvcache_centric, got "fifo"',
        ),
        ('[store]\ndram_bytes = "lots"', "store.dram_bytes: expected a size in bytes"),
        ('[store]\ndram_bytes = "150%"', "a percentage is at most 100%"),
        ('[transfer]\nslice_bytes = "50%"', "a percentage is not allowed here"),
        ('[store]\ndram_bytes = "auto"', "store.dram_bytes: expected a size in bytes"),
        ('[store]\ndram_bytes = "auto"', '"auto" is not allowed here'),
        (
            '[decode]\nkv_cache_bytes = "lots"',
            'decode.kv_cache_bytes: expected "auto", a size in bytes (4096, "512MB", "64GiB", '
            '"1.5TiB") or a percentage ("80%"), got "lots"',
        ),
        (
            '[transfer]\nslice_bytes = "1KiB"',
            "transfer.slice_bytes: expected a size in bytes >= 4KiB",
        ),
        ('[cluster]\nmaster = "localhost"', "cluster.master: expected host:port"),
        ('[cluster]\nname = "My Cluster"', "cluster.name: expected a non-empty name"),
        (
            '[model]\npath = "dummy:"',
            'model.path: expected a model directory, a .gguf file, a built-in name or "dummy:NAME"',
        ),
        (
            "[store]\nhigh_watermark = 0.8\nlow_watermark = 0.8",
            "store.low_watermark: must be below store.high_watermark",
        ),
        ('[cluster]\nsecret = "short"', "cluster.secret: expected at least 16 characters, got 5"),
        (
            '[cluster]\nsecret = "0123456789abcdef"\nsecret_file = "/s"',
            "cluster.secret_file: set either cluster.secret or cluster.secret_file, not both",
        ),
        ("[store\n", "invalid TOML: Expected ']' at the end of a table declaration (at line 1"),
        ('[node]\nport_range = "7000"', 'node.port_range: expected "LOW-HIGH" with 1 <= LOW'),
        ('[node]\nport_range = "7010-7000"', 'node.port_range: expected "LOW-HIGH"'),
        ('[node]\nport_range = "0-10"', 'node.port_range: expected "LOW-HIGH"'),
        ('[node]\nport_range = "65000-70000"', 'got "65000-70000"'),
        ('[node]\nport_range = "a-b"', 'node.port_range: expected "LOW-HIGH"'),
    ],
)
def test_error_messages_name_the_key_and_the_allowed_values(
    tmp_path: Path, text: str, message: str
) -> None:
    errors = errors_of(tmp_path, text)
    assert len(errors) == 1, errors
    assert message in errors[0]
    if "two" in text:
        assert "quotes" not in errors[0]  # the hint only where removing quotes would help


def test_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    (error,) = errors_of(tmp_path, "[api]\nport = = 1\n")
    assert error.startswith(f"{tmp_path / 'mooncake.toml'}: invalid TOML") and "line 2" in error


def test_secret_is_never_echoed_in_errors(tmp_path: Path) -> None:
    (error,) = errors_of(tmp_path, '[cluster]\nsecret = "hunter2"\n')
    assert "hunter2" not in error


def test_all_problems_come_out_together(tmp_path: Path) -> None:
    text = '[stor]\n[store]\nreplicas = 0\nbogus = 1\n[scheduler]\npolicy = "fifo"\n'
    errors = errors_of(
        tmp_path,
        text,
        env={"MOONCAKE_API_PORT": "x", "MOONCAKE_STORE_NOPE": "1"},
        overrides={"decode.max_batch": 0},
    )
    keys = [e.split(":")[0] for e in errors]
    assert keys == [
        "[stor]",
        "store.replicas",
        "store.bogus",
        "scheduler.policy",
        "api.port",
        "MOONCAKE_STORE_NOPE",
        "decode.max_batch",
    ]
    assert "(from MOONCAKE_API_PORT)" in errors[4] and "(from a flag)" in errors[6]


def test_unknown_override_key_and_section() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"store.nope": 1, "stor.replicas": 1})
    assert info.value.errors[0].startswith("store.nope: unknown key")
    assert info.value.errors[1].startswith("stor.replicas: unknown section [stor]")


def test_a_retired_key_names_what_replaced_it() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"transfer.max_handshakes_per_peer": 64})
    assert "replaced by transfer.max_pending_handshakes" in info.value.errors[0]


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "absent.toml", env={})


# --- sizes and secrets ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,num_bytes",
    [
        ("4096", 4096),
        (4096, 4096),
        ("0", 0),
        ("512MB", 512 * 10**6),
        ("64KiB", 65536),
        ("64kib", 65536),
        ("64K", 65536),
        ("2g", 2 << 30),
        ("1.5TiB", 3 << 39),
        ("1.5KB", 1500),
        ("10 B", 10),
    ],
)
def test_parse_size(text: str | int, num_bytes: int) -> None:
    assert parse_size(text) == num_bytes


@pytest.mark.parametrize("text", ["-1GiB", "80%%", "abc", "", "1.2.3GB", "5XB", -1, True, "80%"])
def test_parse_size_rejects_non_sizes(text: object) -> None:
    with pytest.raises(ConfigError, match="expected a size"):
        parse_size(text)  # type: ignore[arg-type]


def test_size_percentages_resolve_against_free_bytes() -> None:
    assert Size.parse("80%").resolve(1000) == 800 and str(Size.parse("80%")) == "80%"
    assert Size.parse("12.5%").fraction == 0.125 and Size.parse("0%").is_zero
    assert Size.parse("64GiB").resolve(1) == 64 << 30 and str(Size.parse("65536")) == "64KiB"
    for bad in ("80%%", "101%", "-5%", "%"):
        with pytest.raises(ConfigError, match="percentage"):
            Size.parse(bad)


def test_auto_size_only_where_a_key_allows_it() -> None:
    """ "auto" parses (any case) only with allow_auto; every error names each allowed form."""
    auto = Size.parse(" Auto ", allow_auto=True)
    assert auto.is_auto and str(auto) == "auto" and not auto.is_zero
    with pytest.raises(ConfigError, match='"auto" is not allowed here: expected a size'):
        Size.parse("auto")
    with pytest.raises(ConfigError, match="expected \"auto\", a size .* or a percentage .*'lots'"):
        Size.parse("lots", allow_auto=True)
    with pytest.raises(ConfigError, match=r"expected a size \(bytes.*\) or a percentage .*'1Q'"):
        Size.parse("1Q")


def test_kv_caches_default_to_auto_and_take_bytes_or_percentages() -> None:
    c = load_config(None, env={}).config
    assert c.prefill.kv_cache_bytes.is_auto and c.decode.kv_cache_bytes.is_auto
    c = load_config(
        None,
        env={"MOONCAKE_DECODE_KV_CACHE_BYTES": "90%"},
        overrides={"prefill.kv_cache_bytes": "64MiB"},
    ).config
    assert c.prefill.kv_cache_bytes == Size(num_bytes=64 << 20)
    assert c.decode.kv_cache_bytes == Size(fraction=0.9)
    c = load_config(None, env={}, overrides={"decode.kv_cache_bytes": "AUTO"}).config
    assert c.decode.kv_cache_bytes.is_auto


def test_require_secret(tmp_path: Path) -> None:
    secret_path = tmp_path / "secret"
    secret_path.write_text("0123456789abcdef\n")
    file_cfg = load_config(env={}, overrides={"cluster.secret_file": str(secret_path)}).config
    assert file_cfg.cluster.require_secret() == "0123456789abcdef"
    env = {"MOONCAKE_CLUSTER_SECRET": "s" * 16}
    assert load_config(env=env).config.cluster.require_secret() == "s" * 16
    with pytest.raises(ConfigError, match="cluster.secret: a multi-node cluster needs"):
        Config().cluster.require_secret()
    secret_path.write_text("short")
    with pytest.raises(ConfigError, match="holds 5 characters"):
        file_cfg.cluster.require_secret()


def test_configs_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Config().store.replicas = 2
    assert StoreConfig(replicas=2).replicas == 2 and TransferConfig().protocol == "auto"


def test_port_range_parses_and_defaults_to_any_port(tmp_path: Path) -> None:
    assert Config().node.port_range == ""
    assert node_ports(Config()) == PortRange() and PortRange().is_any
    loaded = load_config(None, {"MOONCAKE_NODE_PORT_RANGE": "7000-7019"})
    assert node_ports(loaded.config) == PortRange(7000, 7019)
    assert list(PortRange.parse("1-1").ports()) == [1]
    assert PortRange.parse("65535-65535") == PortRange(65535, 65535)
    with pytest.raises(ConfigError, match="node.port_range: .* got '9-1'"):
        PortRange.parse("9-1")
