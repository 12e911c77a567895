"""The HTTP API's settings: `[api]` (where it listens, who may use it: keys from the
config, the environment or a private file); part of `mooncake.config.settings.Config`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import msgspec

from mooncake.config.knob import STRUCT as _STRUCT
from mooncake.config.knob import knob
from mooncake.errors import ConfigError


class ApiConfig(msgspec.Struct, **_STRUCT):
    """[api]: the OpenAI-compatible HTTP front end (on the master)."""

    host: Annotated[str, knob("Address the HTTP API listens on.", min_length=1)] = "0.0.0.0"
    port: Annotated[int, knob("TCP port of the HTTP API.", ge=1, le=65535)] = 8000
    api_keys: Annotated[
        tuple[str, ...],
        knob(
            "Bearer keys accepted by the API; empty (and no api_keys_file) = no auth. Set "
            "them in MOONCAKE_API_API_KEYS (comma-separated) or api_keys_file rather than "
            "on a command line, where every local user can read them (ps).",
            "secret",
        ),
    ] = ()
    api_keys_file: Annotated[
        str,
        knob(
            "Path of a file of bearer keys, one per line (blank lines and lines starting "
            "with # are skipped), accepted besides api_keys. It must be yours and readable "
            "by you alone (mode 0600 or 0400), else the master refuses to start."
        ),
    ] = ""
    allow_unauthenticated: Annotated[
        bool,
        knob(
            "Serve the API on an address other hosts can reach (host not a loopback "
            "address) without API keys: anyone who reaches it may generate and read "
            "/v1/status (node addresses, pids, endpoints). Without it, such a master or "
            "`serve` refuses to start."
        ),
    ] = False
    served_model_name: Annotated[
        str, knob("Model id clients name in requests and /v1/models; empty = model.path.")
    ] = ""
    drain_s: Annotated[
        float,
        knob(
            "Seconds a stopping API server (the master, `mooncake serve`) lets running "
            "requests finish before it ends them with an error (503, or an error event "
            "in a stream).",
            ge=0,
        ),
    ] = 10.0

    def load_keys(self) -> tuple[str, ...]:
        """The bearer keys: api_keys, then those in api_keys_file. Reads the file; raises
        ConfigError if it cannot be read, is not this user's or others may read it."""
        if not self.api_keys_file:
            return self.api_keys
        path = Path(self.api_keys_file)
        try:
            with path.open() as f:  # NOTE: the mode checked is the file's that was read
                st = os.fstat(f.fileno())
                text = f.read()
        except OSError as e:
            raise ConfigError(f"api.api_keys_file: cannot read {path}: {e.strerror or e}") from e
        if st.st_uid != os.getuid():
            raise ConfigError(
                f"api.api_keys_file: {path} belongs to uid {st.st_uid}, not to this user "
                f"(uid {os.getuid()}); chown it to the user that runs mooncake"
            )
        if st.st_mode & 0o077:
            raise ConfigError(
                f"api.api_keys_file: {path} has mode {st.st_mode & 0o777:04o}, which lets "
                f"others read or change the keys; allowed: 0600 or 0400 (chmod 600 {path})"
            )
        lines = (line.strip() for line in text.splitlines())
        return (*self.api_keys, *(k for k in lines if k and not k.startswith("#")))
