"""The transport interface: what moves bytes for one connection inside the progress process.

One module per transport fills this interface; ``transports.REGISTRY`` orders them and
``transports.select`` takes the first whose ``can_connect`` says yes (NCCL's transport.cc). Every
method runs in the progress process; names say which side of a connection they serve:

- ``can_connect(me, peer)``: may this transport carry bytes between the two ranks' memories?
- ``send_setup`` / ``recv_setup``: prepare the sending / receiving end when a rank connects.
- ``proxy_progress(engine, args)``: advance every sub of one args; returns True when all subs of the
  args are done. The progress loop calls it once per pass for each active args; it must never block.
- ``proxy_progress_coll(engine, args)``: the same for a collective, whose subs run chunk schedules
  (proxy/coll/sched.py) instead of plain copies. Optional: the base raises NotImplementedError.
- ``proxy_free(engine)``: release what the transport holds when the progress process exits.

A sub moves ``nbytes`` in ``nsteps`` chunks of at most ``CHUNK_SIZE`` through ``STEPS`` slots with the
counters of DESIGN.md section 5: posted (chunks handed to the copy engine), transmitted (copied out
of the source), received (landed in the destination), done (retired); ``posted < done + STEPS``.
A contract check (``check_transport``) runs when a transport is registered, so that a broken
transport fails at import instead of on first use.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from shmproxy.engine.args import Args


@dataclass(frozen=True)
class PeerInfo:
    """What the progress process knows about a rank when it picks a transport."""

    rank: int
    local_rank: int
    host: str
    pid: int
    node: int = 0


class Transport(ABC):
    name: str = "?"

    @abstractmethod
    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        """True when this transport can carry messages between ``me`` and ``peer``."""

    def send_setup(self, engine: Any, me: PeerInfo, peer: PeerInfo) -> None:
        """Prepare ``me`` as the sending end towards ``peer``. Default: nothing to prepare."""
        return None

    def recv_setup(self, engine: Any, me: PeerInfo, peer: PeerInfo) -> None:
        """Prepare ``me`` as the receiving end from ``peer``. Default: nothing to prepare."""
        return None

    @abstractmethod
    def proxy_progress(self, engine: Any, args: "Args") -> bool:
        """Advance the subs of ``args`` without blocking; True once every sub is done."""

    def proxy_progress_coll(self, engine: Any, args: "Args") -> bool:
        """Advance the chunk schedules of a collective args; True when done. Transports that cannot
        run collectives between the ranks they connect leave this unimplemented."""
        raise NotImplementedError(f"transport {self.name} does not run collective schedules")

    def proxy_free(self, engine: Any) -> None:
        """Release transport resources at progress-process exit. Default: none held."""
        return None


_REQUIRED = ("can_connect", "proxy_progress")


def check_transport(t: Transport) -> Transport:
    """The contract check run at registration: a broken plug-in fails at import."""
    if not isinstance(t, Transport):
        raise TypeError(f"{t!r} is not a transports.base.Transport")
    if not t.name or t.name == "?":
        raise TypeError(f"transport {type(t).__name__} has no name")
    for meth in _REQUIRED:
        if getattr(type(t), meth, None) is getattr(Transport, meth):
            raise TypeError(f"transport {t.name} does not implement {meth}")
    return t
