"""A store node: pool memory only (`role`: its tiers mounted with the master)."""
