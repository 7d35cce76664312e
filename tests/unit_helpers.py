"""Helpers the single-process unit tests share: a small ops pool in /dev/shm (the ``pool`` fixture)
and a caller of the progress process's take (``_taker``)."""
from __future__ import annotations

import numpy as np
import pytest

from shmproxy.shm import _native, pool as P
from shmproxy.shm.segment import Segment


@pytest.fixture
def pool():
    lay = P.Layout(2, 8, 16)
    seg = Segment.create("unittest", lay.total_bytes)
    view = P.PoolView.initialize(seg.mm, seg.addr, lay)
    try:
        yield seg, view
    finally:
        view.release()
        seg.close()


def _taker(seg, lay):
    """(take(batch) -> take_posted's result, the record copies, their indices)."""
    out, idx = bytearray(P.RECORD_BYTES * lay.nrecords), np.zeros(lay.nrecords, np.int32)

    def take(batch=16):
        return _native.take_posted(seg.addr, lay.records_off, lay.rank_area_off, lay.nrecords, lay.max_ops, batch,
                                   _native.buffer_info(out, True)[0], idx.ctypes.data)
    return take, out, idx
