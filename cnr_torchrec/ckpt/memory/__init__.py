"""The memory tier: each rank's restore image in host shared memory, sealed per commit (docs/memory-tier.md)."""
