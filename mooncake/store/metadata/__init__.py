"""The Store's metadata on the master: pure logic, no I/O and no threads (the simulator
runs the same code).

- `service`     `MetadataService`, the pool's API over one `Pool`
- `pool`, `poolstate`, `poolorder`   the state as one structure, as plain entries, the
                eviction order
- `objects`, `settings`, `segments`, `allocator`, `placement`   records, settings, space
- `writes`, `slots`, `eviction`, `moves`, `membership`   the protocols that change it
- `journal`, `audit`   durability, stats and the integrity check
- `groupcommit`   the journal's writes in groups, off the Store's lock (a thread: the
                master's, not the simulator's)
"""
