"""What the progress process knows of each local rank (filled in by the control plane)."""
from __future__ import annotations


class RankInfo:
    __slots__ = ("rank", "local_rank", "pid", "host", "affinity", "closed", "dead", "mapped")

    def __init__(self, rank: int, local_rank: int, pid: int, host: str, affinity_: list[int]):
        self.rank, self.local_rank, self.pid, self.host = rank, local_rank, pid, host
        self.affinity = affinity_
        self.closed = self.dead = self.mapped = False
