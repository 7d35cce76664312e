"""The progress process: its loop, args and subs, copy engine, profiler and CPU affinity."""
