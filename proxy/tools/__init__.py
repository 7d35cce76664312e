"""Tools: the dump, the benchmark and the host probe (their console scripts are thin)."""
