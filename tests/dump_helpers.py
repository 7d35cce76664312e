"""What the dump tests (tests/test_dump.py, tests/test_dump_cli.py) share: the repository root, the tag
that names their segments, and the text line of the sub that both build.
"""
from __future__ import annotations

import os
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
TAG = f"dumptest{os.getpid()}"
SUB_LINE = ("args 12 sub 3 [P] 0->1 opCount 5 1048576 B steps 3/8 posted 4 transmitted 3 received 3 "
            "done 3")
