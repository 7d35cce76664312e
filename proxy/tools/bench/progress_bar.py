"""The progress bar of long sweeps, on rank 0's stderr."""
from __future__ import annotations

import sys
from typing import Any


class Progress:
    """A progress bar for long sweeps on rank 0's stderr: tqdm when installed (an optional extra),
    else one rewritten text line. Disabled, it does nothing."""

    def __init__(self, total: int, label: str, enabled: bool, stream: Any = None):
        self.total, self.label, self.enabled = total, label, enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self._tqdm = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._tqdm = tqdm(total=total, desc=label, file=self.stream, leave=False, unit="size")

    def step(self, what: str) -> None:
        """Called before each size: shows the size about to run and how many are done."""
        if not self.enabled:
            return
        if self._tqdm is not None:
            if self.done:
                self._tqdm.update(1)
            self._tqdm.set_postfix_str(what)
        else:
            # Cursor back to column 0 afterwards: the next table row overwrites the line.
            self.stream.write(f"\r# {self.label}: {self.done}/{self.total} sizes done, now {what}   \r")
            self.stream.flush()
        self.done += 1

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.update(1)
            self._tqdm.close()
        else:
            self.stream.write(f"\r# {self.label}: {self.total}/{self.total} sizes done{' ' * 30}\n")
            self.stream.flush()
