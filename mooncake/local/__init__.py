"""`mooncake up --local`: a whole cluster as child processes on this machine.

- `launcher`    `LocalLauncher`: the plan, the processes, start and stop
- `config`      the one config file it writes for its nodes
- `cost`        its cost model, profiled once per model shape and cached
- `supervisor`  restarts nodes that exit (backoff, a limit per window)
- `runfile`     the private run directory and the runfile saying where the cluster is
"""
