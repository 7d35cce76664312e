"""Whether a process of this host is alive, as the progress process and the transports ask it."""
from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """True while ``pid`` runs: a zombie (exited, not yet reaped by its parent) counts as dead, and a
    process we may not signal as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
