"""`mooncake_master`: our master started with upstream Mooncake's command line.

Upstream's `mooncake_master` (kvcache-ai/Mooncake `mooncake-store/src/master.cpp`, gflags)
is what vLLM's, SGLang's and LMCache's Mooncake guides start. This console script takes the
same flags (`--flag=value`, `--flag value`, `--noflag`: `gflags.py`), maps each onto our
config (`plan_master`) and runs our master role (Store metadata, the Conductor, the API on
loopback, `/metrics` and upstream's admin queries on the metrics port: `admin.py`).

Mapped onto our config:

- `--port`, `--rpc_port` (wins when > 0), `--rpc_address`: `cluster.master`;
- `--default_kv_lease_ttl` (ms, or 500ms/2s/1m/1h): `store.lease_ttl_s`;
- `--eviction_high_watermark_ratio`: `store.high_watermark`; `--eviction_ratio`:
  `store.low_watermark` = high watermark - ratio (upstream evicts that share below the high
  watermark), so 0 < ratio < high watermark;
- `--client_ttl` (s): `store.heartbeat_ttl_s`;
- `--metrics_port`, `--metrics_host`: `metrics.port`, `metrics.host` (1-65535: our 0 would
  mean the API port);
- `--enable_ha` with `--etcd_endpoints` (`;`-separated) or `--ha_backend_connstring`:
  `cluster.etcd` (http:// added where no scheme is given); `--cluster_id` then names the
  cluster (`cluster.name`, `_` as `-`);
- `--enable_http_metadata_server`, `--http_metadata_server_port`/`_host`: upstream's HTTP
  metadata server started beside the master (`start_metadata_server`);
- `--memory_allocator=offset`: ours is an offset allocator (`cachelib` is refused).

Accepted with a warning that they have no effect here: threads, RPC socket tuning, pod
labels, KV event labels, put timeouts, `--allocation_strategy`, `--enable_metric_reporting`,
`--enable_metadata_cleanup_on_timeout`. Every other flag upstream defines (offload,
SSD/NoF/CXL, snapshots, oplog, tenants, soft-pin defaults, promotion, dynamic replication,
KV events, `--config_path`, `--rpc_interface`) is accepted at its default value and refused,
with the reason, at any other. An unknown flag is an error, as in gflags.

Our own additions: `--mooncake_config=PATH` (our TOML file, beneath the flags) and the
`MOONCAKE_*` variables as for every node. The master needs the cluster secret
(`MOONCAKE_CLUSTER_SECRET` or `MOONCAKE_CLUSTER_SECRET_FILE`, >= 16 characters) and refuses
to start without one: every client and store node authenticates with it.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from mooncake.config.load import load_config
from mooncake.errors import ConfigError, MooncakeError
from mooncake.roles.master.gflags import FlagSpec, Kind, parse_gflags

log = logging.getLogger(__name__)

# NOTE: our `mooncake_http_metadata_server` (upstream's protocol and flags; upstream:
# mooncake-wheel/mooncake/http_metadata_server.py), run as a module
METADATA_SERVER_MODULE = "mooncake.engine.httpmeta"
METADATA_START_TIMEOUT_S = 15.0  # seconds the metadata server may take to listen


def _f(kind: Kind, help: str) -> FlagSpec:
    return FlagSpec(kind, help)


# name -> spec, for the flags this script maps onto our config
MAPPED: dict[str, FlagSpec] = {
    "port": _f("int", "RPC port of the master (default 50051)."),
    "rpc_port": _f("int", "RPC port; preferred over --port when > 0."),
    "rpc_address": _f("str", "Address the RPC server binds to (default 0.0.0.0)."),
    "default_kv_lease_ttl": _f("duration_ms", "Read lease of an object (default 10000 ms)."),
    "eviction_ratio": _f("float", "Share evicted below the high watermark (default 0.05)."),
    "eviction_high_watermark_ratio": _f("float", "Fill share that starts eviction (0.95)."),
    "client_ttl": _f("int", "Seconds a client lives after its last heartbeat (default 10)."),
    "metrics_port": _f("int", "Port of /metrics and the admin queries (default 9003)."),
    "metrics_host": _f("str", "Address of the metrics port (default 0.0.0.0)."),
    "enable_ha": _f("bool", "Masters elect a leader on etcd (--etcd_endpoints)."),
    "etcd_endpoints": _f("str", "etcd endpoints, separated by ';'."),
    "ha_backend_type": _f("str", "HA backend: etcd only here."),
    "ha_backend_connstring": _f("str", "HA backend endpoints (etcd: as --etcd_endpoints)."),
    "cluster_id": _f("str", "Cluster name (default mooncake_cluster)."),
    "enable_http_metadata_server": _f("bool", "Serve the HTTP metadata server too."),
    "http_metadata_server_port": _f("int", "Its port (default 8080)."),
    "http_metadata_server_host": _f("str", "Its address (default 0.0.0.0)."),
    "memory_allocator": _f("str", "offset (ours); cachelib is refused."),
}
# flags accepted with a warning: they tune what has no counterpart here
_IGNORED_KINDS: tuple[tuple[str, Kind], ...] = (
    ("max_threads", "int"),
    ("rpc_thread_num", "int"),
    ("rpc_conn_timeout_seconds", "int"),
    ("rpc_enable_tcp_no_delay", "bool"),
    ("enable_metric_reporting", "bool"),
    ("enable_metadata_cleanup_on_timeout", "bool"),
    ("allocation_strategy", "str"),
    ("pod_name", "str"),
    ("pod_namespace", "str"),
    ("put_start_discard_timeout_sec", "int"),
    ("put_start_release_timeout_sec", "int"),
    ("kv_events_model_name", "str"),
    ("kv_events_tenant_id", "str"),
    ("kv_events_additional_salt", "str"),
    ("kv_events_lora_name", "str"),
    ("kv_events_block_size", "int"),
    ("kv_events_dp_rank", "int"),
)
IGNORED = {name: _f(kind, "Accepted; no effect here.") for name, kind in _IGNORED_KINDS}
# upstream flags without a counterpart: (kind, default); only the default is accepted
REFUSED: dict[str, tuple[Kind, object]] = {
    "config_path": ("str", ""),
    "rpc_interface": ("str", ""),
    "default_kv_soft_pin_ttl": ("duration_ms", 1_800_000),
    "max_kv_soft_pin_ttl": ("duration_ms", 86_400_000),
    "allow_evict_soft_pinned_objects": ("bool", True),
    "nof_eviction_ratio": ("float", None),
    "nof_eviction_high_watermark_ratio": ("float", None),
    "enable_offload": ("bool", False),
    "offload_on_evict": ("bool", False),
    "offload_force_evict": ("bool", False),
    "offloading_queue_limit": ("int", 50000),
    "offload_cap_ratio": ("float", 0.5),
    "promotion_on_hit": ("bool", False),
    "promotion_admission_threshold": ("int", 2),
    "promotion_queue_limit": ("int", 50000),
    "promotion_max_per_heartbeat": ("int", 1),
    "dynamic_replication_mode": ("str", "off"),
    "dynamic_replication_heat_window_seconds": ("int", 10),
    "dynamic_replication_admission_qps_threshold": ("float", 0.8),
    "dynamic_replication_max_memory_replicas": ("int", 2),
    "enable_kv_events": ("bool", False),
    "kv_events_bind_endpoint": ("str", ""),
    "kv_events_backend_id": ("str", ""),
    "kv_events_emit_legacy_compat": ("bool", True),
    "kv_events_emit_object_key": ("bool", True),
    "kv_events_queue_capacity": ("int", 65536),
    "nof_heartbeat_interval_sec": ("int", None),
    "nof_heartbeat_probe_timeout_ms": ("int", None),
    "nof_heartbeat_failures_threshold": ("int", None),
    "root_fs_dir": ("str", ""),
    "global_file_segment_size": ("int", None),
    "enable_oplog": ("bool", False),
    "oplog_poll_interval_ms": ("int", 1000),
    "oplog_batch_max_entries": ("int", 1024),
    "batch_oplog_retry_timeout_sec": ("int", 180),
    "enable_disk_eviction": ("bool", True),
    "quota_bytes": ("int", 0),
    "enable_multi_tenants": ("bool", False),
    "tenant_quota_connector_type": ("str", "file"),
    "tenant_quota_connector_uri": ("str", ""),
    "snapshot_backup_dir": ("str", ""),
    "enable_snapshot_restore": ("bool", False),
    "enable_snapshot": ("bool", False),
    "snapshot_interval_seconds": ("int", None),
    "snapshot_child_timeout_seconds": ("int", None),
    "snapshot_retention_count": ("int", None),
    "snapshot_object_store_type": ("str", ""),
    "snapshot_payload_store_type": ("str", ""),
    "snapshot_payload_backend_type": ("str", ""),
    "snapshot_catalog_store_type": ("str", ""),
    "snapshot_catalog_backend_type": ("str", ""),
    "snapshot_catalog_store_connstring": ("str", ""),
    "snapshot_catalog_backend_connstring": ("str", ""),
    "max_total_finished_tasks": ("int", 10000),
    "max_total_pending_tasks": ("int", 10000),
    "max_total_processing_tasks": ("int", 10000),
    "pending_task_timeout_sec": ("int", 300),
    "processing_task_timeout_sec": ("int", 300),
    "max_retry_attempts": ("int", 10),
    "cxl_path": ("str", None),
    "cxl_size": ("int", None),
    "enable_cxl": ("bool", False),
}
OURS: dict[str, FlagSpec] = {
    "mooncake_config": _f("str", "Our TOML config file, beneath these flags."),
    "help": _f("bool", "Show the flags and exit."),
    "version": _f("bool", "Show the version and exit."),
}
FLAGS: dict[str, FlagSpec] = {
    **MAPPED,
    **IGNORED,
    **{name: _f(kind, "Refused unless its default.") for name, (kind, _d) in REFUSED.items()},
    **OURS,
}
_REFUSAL_REASON = {
    "config_path": "upstream's JSON config has no reader here; give flags or --mooncake_config",
    "rpc_interface": "give the address with --rpc_address",
    "root_fs_dir": "a store node's SSD tier is our persistent tier (store.ssd_bytes, "
    "store.ssd_path)",
}


@dataclass
class MasterPlan:
    """What the flags ask for, in our terms."""

    overrides: dict[str, object] = field(default_factory=dict)  # dotted config key -> value
    warnings: list[str] = field(default_factory=list)
    config_path: str = ""  # --mooncake_config
    metadata_server: tuple[str, int] | None = None  # (host, port) to start one on


def plan_master(values: dict[str, object]) -> MasterPlan:
    """Our config overrides and side services for parsed upstream flags; raises ConfigError
    listing every flag that cannot be honoured."""
    plan, errors = MasterPlan(), []
    get = values.get
    port = int(get("rpc_port", 0) or 0) or int(get("port", 50051))  # type: ignore[call-overload]
    host = str(get("rpc_address", "0.0.0.0"))
    plan.overrides["cluster.master"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    plan.overrides["store.lease_ttl_s"] = int(get("default_kv_lease_ttl", 10_000)) / 1000  # type: ignore[call-overload]
    high = float(get("eviction_high_watermark_ratio", 0.95))  # type: ignore[arg-type]
    ratio = float(get("eviction_ratio", 0.05))  # type: ignore[arg-type]
    if not 0 < ratio < high:
        errors.append(
            f"--eviction_ratio={ratio:g}: our eviction brings a tier down to a low watermark of "
            f"high watermark - ratio, which must lie above 0; give 0 < ratio < {high:g}"
        )
    plan.overrides["store.high_watermark"] = high
    plan.overrides["store.low_watermark"] = round(high - ratio, 9)
    if "client_ttl" in values:
        plan.overrides["store.heartbeat_ttl_s"] = float(values["client_ttl"])  # type: ignore[arg-type]
    metrics_port = int(get("metrics_port", 9003))  # type: ignore[call-overload]
    if not 0 < metrics_port < 65536:
        errors.append(f"--metrics_port={metrics_port}: give a port 1-65535")
    plan.overrides["metrics.enabled"] = True
    plan.overrides["metrics.port"] = metrics_port
    plan.overrides["metrics.host"] = str(get("metrics_host", "0.0.0.0"))
    # NOTE: the OpenAI API of our master is not part of upstream's: on loopback, a free port
    plan.overrides["api.host"] = "127.0.0.1"
    plan.overrides["api.port"] = _free_loopback_port()
    _plan_ha(values, plan, errors)
    if get("enable_http_metadata_server", False):
        mport = int(get("http_metadata_server_port", 8080))  # type: ignore[call-overload]
        plan.metadata_server = (str(get("http_metadata_server_host", "0.0.0.0")), mport)
    if get("memory_allocator", "offset") != "offset":
        errors.append(
            f"--memory_allocator={values['memory_allocator']}: only offset (our segments' "
            "allocator) is available"
        )
    plan.config_path = str(get("mooncake_config", ""))
    for name in sorted(values.keys() & IGNORED.keys()):
        plan.warnings.append(f"--{name}: accepted; it has no effect on this master")
    for name in sorted(values.keys() & REFUSED.keys()):
        default = REFUSED[name][1]
        if values[name] != default:
            why = _REFUSAL_REASON.get(name, "this master has no such feature")
            shown = f" (only its default, {default})" if default not in (None, "") else ""
            errors.append(f"--{name}={values[name]}: not supported{shown}: {why}")
    if errors:
        raise ConfigError(errors)
    return plan


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _plan_ha(values: dict[str, object], plan: MasterPlan, errors: list[str]) -> None:
    get = values.get
    endpoints = str(get("ha_backend_connstring", "") or get("etcd_endpoints", ""))
    if not get("enable_ha", False):
        if endpoints:
            plan.warnings.append("--etcd_endpoints without --enable_ha: not used")
        return
    backend = str(get("ha_backend_type", "etcd"))
    if backend != "etcd":
        errors.append(f"--ha_backend_type={backend}: only etcd is available")
        return
    urls = [e.strip() for e in endpoints.replace(",", ";").split(";") if e.strip()]
    if not urls:
        errors.append("--enable_ha: give the etcd endpoints with --etcd_endpoints=host:2379;...")
        return
    plan.overrides["cluster.etcd"] = [u if "://" in u else f"http://{u}" for u in urls]
    name = str(get("cluster_id", "mooncake_cluster")).lower().replace("_", "-")
    plan.overrides["cluster.name"] = name


def help_text() -> str:
    rows = [f"  --{n}  {s.help}" for n, s in {**MAPPED, **OURS}.items()]
    ignored = ", ".join(sorted(IGNORED))
    refused = ", ".join(sorted(REFUSED))
    return (
        "mooncake_master: this package's master with upstream Mooncake's flags "
        "(--flag=value or --flag value; --noflag for false)\n\n"
        + "\n".join(rows)
        + f"\n\naccepted without effect: {ignored}\n\nonly their defaults: {refused}\n\n"
        "The cluster secret comes from MOONCAKE_CLUSTER_SECRET (or _FILE); MOONCAKE_* "
        "variables set any other key of ours.\n"
    )


class MetadataServerProcess:
    """Upstream's HTTP metadata server as a child process beside the master."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it and wait until its port takes connections; raises ConfigError when it
        does not come up."""
        cmd = [sys.executable, "-m", METADATA_SERVER_MODULE]
        # NOTE: its stdout goes to our stderr: our stdout carries the ready handshake
        args = [*cmd, "--host", self.host, "--port", str(self.port)]
        self.proc = subprocess.Popen(args, stdout=sys.stderr.fileno())
        probe = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host.strip("[]")
        deadline = time.monotonic() + METADATA_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError(
                    f"--enable_http_metadata_server: the metadata server exited "
                    f"(status {self.proc.returncode}) before listening on port {self.port}"
                )
            try:
                socket.create_connection((probe, self.port), timeout=0.5).close()
                log.info("HTTP metadata server on %s:%d", self.host, self.port)
                return
            except OSError:
                time.sleep(0.05)  # NOTE: a readiness poll of a child we do not control
        self.stop()
        raise ConfigError(
            f"--enable_http_metadata_server: nothing listens on port {self.port} after "
            f"{METADATA_START_TIMEOUT_S:g} s"
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def start_metadata_server(host: str, port: int) -> MetadataServerProcess:
    """The one call that starts upstream's HTTP metadata server beside the master."""
    server = MetadataServerProcess(host, port)
    server.start()
    return server


def main(argv: Sequence[str] | None = None) -> int:
    """The `mooncake_master` console script; exit status 2 on bad flags or config."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        values = parse_gflags(args, FLAGS)
        if values.get("help"):
            sys.stdout.write(help_text())
            return 0
        if values.get("version"):
            from mooncake import __version__

            sys.stdout.write(f"mooncake_master (mooncake {__version__}, upstream flags)\n")
            return 0
        plan = plan_master(values)
        for warning in plan.warnings:
            log.warning(warning)
        cfg = load_config(plan.config_path or None, overrides=plan.overrides).config
        cfg.cluster.require_secret()
        from mooncake.roles import run_node

        metadata = start_metadata_server(*plan.metadata_server) if plan.metadata_server else None
        try:
            run_node(cfg, "master")
        finally:
            if metadata is not None:
                metadata.stop()
    except MooncakeError as e:
        sys.stderr.write(f"mooncake_master: {e}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
