"""The Store client: `client` (`Store`: put/get/exists/remove, zero-copy and batch forms),
`datapath` (the data plane to replicas), `grants` (what it reuses of the master's answers)
and `relocator` (copies the master moved to make room on the writer's node)."""
