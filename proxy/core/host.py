"""Facts about this host that the ranks and the progress process both decide by, alike."""
from __future__ import annotations

import os


def crowded(nlocal: int) -> bool:
    """Fewer cores than local ranks + 2: the ranks, the progress loop and its copy workers share
    cores. Then a rank sleeps at once on requests the copy workers move (proxy/rank/lifecycle.py), and
    the loop does not spin right after completing such work (proxy/engine/completion.py,
    complete_large)."""
    return (os.cpu_count() or 1) < nlocal + 2


def memory_bytes() -> int:
    """The node's memory (what automatic sizes that take memory of every communicator scale with)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
