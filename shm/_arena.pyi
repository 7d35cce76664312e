# A C extension (shm/_arena.c): mypy cannot read it, so every name it exports is typed Any here. The
# Python wrappers around it carry the types (a partial stub: PEP 484's module __getattr__).
from typing import Any

def __getattr__(name: str) -> Any: ...
