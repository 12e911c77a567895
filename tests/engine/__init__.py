"""Tests of mooncake.engine: upstream's Python Transfer Engine API."""
