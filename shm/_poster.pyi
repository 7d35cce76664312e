# A C extension (shm/_poster*.c): mypy cannot read it. The request's C base and Status are typed here
# (their fields are the C structs' members, shm/_poster_request.c); every other name it exports is
# typed Any (a partial stub: PEP 484's module __getattr__), the Python wrappers carrying the types.
from typing import Any

class Status:
    source: int
    tag: int
    nbytes: int
    @property
    def cancelled(self) -> bool: ...
    def __init__(self, source: int, tag: int, nbytes: int, cancelled: bool = ...) -> None: ...

class RequestBase:
    _comm: Any
    _keep: Any
    _stage: Any
    _error: Any
    status: Status | None
    _extra: Any
    _seq: int
    _tag: int
    _nbytes: int
    _user_addr: int
    _slot: int
    _kind: int
    _peer: int
    _done: bool
    def __init__(self, comm: Any, slot: int, seq: int, kind: int, peer: int, tag: int, nbytes: int, keep: Any,
                 stage: Any, user_addr: int, poster: Any = ...) -> None: ...
    def Wait(self, timeout: float | None = ...) -> Status | None: ...
    def Test(self) -> bool: ...

def __getattr__(name: str) -> Any: ...
