"""The master process: Store metadata, Conductor, registry, HTTP API, metrics.

- `role`        `run_master`: wires the parts below and serves
- `cluster`     `ClusterBackend`: a request's way through the cluster
- `flight`, `tickets`, `nodecalls`   a request as tracked; the Conductor on its own thread;
                the calls to a request's nodes
- `registry`    the nodes and the prefill pipeline groups
- `ha`          the file journal, or the etcd election and takeover
- `timeline`, `attribution`, `metrics`, `storefeed`   what the master observes and exports
"""
