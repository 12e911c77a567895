"""A node's part of the pool: `node` (`StoreNode`: mounts tiers, heartbeats, carries out
the master's instructions) and `tiers` (DRAM, VRAM and SSD tiers as segments)."""
