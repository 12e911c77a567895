"""The etcd keys of the [cluster] section (`cluster.etcd*`, the election's timing): where the
masters elect a leader and keep the pool's state, and how they log in there (docs/ha.md).
`ClusterConfig` inherits them.

No `from __future__ import annotations` here: configdoc reads these annotations as objects.
"""

from typing import Annotated

import msgspec

from mooncake.config.knob import knob

# NOTE: measured with `mooncake bench store --clients 8 --journals file,etcd` (docs/ha.md)
COMMIT_WINDOW_S = 0.0
COMMITS_IN_FLIGHT = 1


# NOTE: the struct options spelled out (not configknob.STRUCT): ClusterConfig inherits
# this struct, and mypy must see that it is frozen
class EtcdConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Masters on etcd: where, as whom, and the election's timing."""

    etcd: Annotated[
        tuple[str, ...],
        knob(
            'etcd client URLs ("http://host:2379"); set: masters elect a leader there and '
            "keep the pool's state there (docs/ha.md); empty = one master, no etcd."
        ),
    ] = ()
    etcd_user: Annotated[
        str,
        knob(
            'etcd v3 auth user the masters and nodes log in as; "" = etcd runs without auth '
            "(then whoever reaches it can rewrite the cluster's keys; docs/ha.md)."
        ),
    ] = ""
    etcd_password: Annotated[
        str,
        knob(
            "Password of etcd_user: set it in MOONCAKE_CLUSTER_ETCD_PASSWORD or the config "
            "file, never as a flag (every local user sees a command line); or etcd_password_file.",
            "secret",
        ),
    ] = ""
    etcd_password_file: Annotated[
        str, knob("Path of a file holding etcd_user's password; use instead of etcd_password.")
    ] = ""
    etcd_ca_file: Annotated[
        str,
        knob(
            "PEM file of the CA that signed etcd's server certificate (https:// endpoints); "
            '"" = the system\'s CAs.'
        ),
    ] = ""
    etcd_cert_file: Annotated[
        str,
        knob(
            "PEM client certificate presented to etcd over https (etcd --client-cert-auth), "
            'with etcd_key_file; "" = none.'
        ),
    ] = ""
    etcd_key_file: Annotated[
        str, knob("PEM private key of etcd_cert_file (keep it mode 0600).")
    ] = ""
    etcd_prefix: Annotated[
        str,
        knob(
            "etcd key prefix; this cluster's keys live under <etcd_prefix>/<name>, so several "
            "clusters share one etcd.",
            pattern="^/[A-Za-z0-9/_.-]*$",
        ),
    ] = "/mooncake"
    etcd_timeout_s: Annotated[float, knob("Seconds an etcd call may take.", gt=0)] = 2.0
    leader_ttl_s: Annotated[
        float,
        knob(
            "Seconds of a master's etcd lease: a dead leader is replaced within about this "
            "long (a leader that cannot renew it for half of it steps down).",
            ge=1,
        ),
    ] = 3.0
    election_poll_s: Annotated[
        float, knob("Seconds between a standby master's reads of who leads.", gt=0)
    ] = 0.25
    etcd_commit_window_s: Annotated[
        float,
        knob(
            "Seconds the leading master's journal waits after a change for more before it "
            "writes them as one etcd transaction (group commit; 0 = write what is queued). "
            "A wider window makes fewer, larger transactions: less etcd CPU per change, "
            "a little more latency per committing call.",
            ge=0,
            le=0.1,
        ),
    ] = COMMIT_WINDOW_S
    etcd_commits_in_flight: Annotated[
        int,
        knob(
            "Journal transactions the leading master keeps in flight at once (groups that "
            "change no key in common). More hide etcd's round trip and disk sync; on a host "
            "short of CPU they make groups smaller.",
            ge=1,
            le=16,
        ),
    ] = COMMITS_IN_FLIGHT
