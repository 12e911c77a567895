"""Configuration: one TOML file, typed frozen settings, defaults < file < env < flags.

- `settings`   `Config`, one frozen struct per TOML section
- `knob`       `knob()`, the metadata (meaning, unit, constraints) every setting carries
- `roles`, `api`, `router`, `etcd`, `rdma`   the sections of the serving roles, the HTTP
               API, the event feeds, etcd and the RDMA transport
- `sizes`, `portrange`   byte sizes and budgets; the node port range every listener binds in
- `load`       `load_config`: stacking, conversion, every problem in one `ConfigError`
- `doc`        the per-key table behind `config show` and the example file
"""
