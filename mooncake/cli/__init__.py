"""The `mooncake` command: a typer app, one thin module per verb.

Verb modules register themselves on `app` (or on a group such as `bench_app`) when
imported; `app.py` imports every module of this package, so adding a verb is adding a file.
Heavy imports (torch, zmq) happen inside command functions so `mooncake --help` stays fast.
"""
