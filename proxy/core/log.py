"""Logging by subsystem, silent by default.

``SHMPROXY_DEBUG=WARN|INFO|TRACE`` turns it on, ``SHMPROXY_DEBUG_SUBSYS=INIT,PROXY`` (or ``^SHM`` to
exclude) selects subsystems, ``SHMPROXY_DEBUG_FILE=/tmp/log.%h.%p`` sends it to a file. Every line
starts with ``host:pid:rank`` so that the interleaved output of a job can be sorted out.

Loggers are standard ``logging`` loggers named ``shmproxy.<SUBSYS>``; an application that configures
logging itself sees them like any other.
"""
from __future__ import annotations

import logging
import os
import socket
import sys

TRACE = 5
logging.addLevelName(TRACE, "TRACE")

_LEVELS = {"NONE": logging.CRITICAL + 10, "WARN": logging.WARNING, "INFO": logging.INFO, "TRACE": TRACE}
_rank = "-"
_configured = False


class _SubsysFilter(logging.Filter):
    def __init__(self, spec: str):
        super().__init__()
        parts = [p for p in spec.split(",") if p]
        self.exclude = {p[1:] for p in parts if p.startswith("^")}
        self.include = {p for p in parts if not p.startswith("^")}

    def filter(self, record: logging.LogRecord) -> bool:
        sub = record.name.rsplit(".", 1)[-1]
        if sub in self.exclude:
            return False
        return not self.include or "ALL" in self.include or sub in self.include


class _Prefix(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.prefix = f"{socket.gethostname()}:{os.getpid()}:{_rank}"
        return super().format(record)


def set_rank(rank: int | str) -> None:
    """Name this process in every later log line (a rank number, or 'proxy')."""
    global _rank
    _rank = str(rank)


def configure(params) -> None:
    """Install the handler once, from the resolved params (idempotent)."""
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger("shmproxy")
    root.propagate = False
    root.setLevel(_LEVELS[params.DEBUG])
    if params.DEBUG == "NONE":
        root.addHandler(logging.NullHandler())
        return
    if params.DEBUG_FILE:
        path = params.DEBUG_FILE.replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
        handler: logging.Handler = logging.FileHandler(path)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Prefix("%(prefix)s %(name)s %(levelname)s %(message)s"))
    handler.addFilter(_SubsysFilter(params.DEBUG_SUBSYS))
    root.addHandler(handler)
    for p in params.items():
        if p.origin != "default":
            root.getChild("INIT").info("%s set by %s to %s", p.env_name(), p.origin, p.value)


def get(subsys: str) -> logging.Logger:
    """The logger of one subsystem: INIT, PROXY, SHM, NET, SERVICE, BOOTSTRAP, COLL, MPI."""
    return logging.getLogger("shmproxy." + subsys)
