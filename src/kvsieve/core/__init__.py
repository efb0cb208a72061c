"""Core contracts shared by every method: configs, the registry, input checks, stats and seeds."""
