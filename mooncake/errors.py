"""The exceptions the outside world can cause.

`assert` marks our own bugs; everything a user, a peer or the hardware can cause raises a
subclass of `MooncakeError` whose message says what was wrong and what to do.
"""


class MooncakeError(Exception):
    """Base of every error mooncake raises on purpose."""

    exit_code = 2  # the `mooncake` command's exit status when this ends it


class ConfigError(MooncakeError):
    """A configuration file, environment variable or flag is invalid.

    `errors` lists every problem found (one line each, naming the key), so a user fixes a
    file in one pass instead of one error per run.
    """

    def __init__(self, errors: list[str] | str):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


class PortInUseError(ConfigError):
    """A port this node was told to listen on is held by another process.

    Its own exit status lets a launcher that chose the port (`mooncake up --local` picks
    free ports before starting the nodes that bind them) choose again and retry."""

    exit_code = 3


class TopologyError(MooncakeError):
    """Hardware detection failed in a way the node cannot work around."""


class TransferError(MooncakeError):
    """A transfer could not be carried out (bad request, dead peer, timeout)."""


class StoreError(MooncakeError):
    """A KV pool operation failed (no such object, no space, lost replica)."""


class SchedulingError(MooncakeError):
    """The Conductor cannot place a request."""


class ApiError(MooncakeError):
    """An HTTP API request is invalid or cannot be served."""


class RpcError(MooncakeError):
    """A control-plane call failed: timeout, refused authentication, bad message."""


class RpcTimeout(RpcError):
    """A control-plane call got no reply within its timeout."""


class AuthError(RpcError):
    """A peer could not prove it knows the cluster secret."""


class ProtocolError(RpcError):
    """A control-plane frame was malformed, too large or of an unknown type."""
