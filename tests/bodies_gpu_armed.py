"""GPU bodies of armed routes (proxy/engine/armed.py): repeated device messages that C launches at the
fetch of their second half, and the orders MPI's matching imposes around them. Every case checks
the bytes each receive got, with contents that change per iteration, so a route fired into the wrong
buffer, out of order, or with stale data shows."""
from __future__ import annotations

import time
from typing import Any

import numpy as np

import shmproxy
from tests.bodies_gpu import _cp
from tests.bodies_gpu_more import _dumped_state

N = 1 << 18   # float32 elements: 1 MiB, where the GPU publishes a message's completions by default


def armed_routes() -> dict:
    """Ranks 0 and 1 (any others idle): a blocking ping-pong, the same messages mixed with host
    messages of the same tag (fast-path cells first in order), two buffers alternating under one tag,
    two receives posted ahead of their sends, a wildcard receive, a cancelled armed receive (one that
    still matched would take the message meant for the next receive, which would never end), and
    probes before a receive (a message held out of matching would hang the blocking one)."""
    cp = _cp()
    bad: list = []
    cases = 0
    with shmproxy.init() as comm:
        me = comm.rank
        a, b = cp.zeros(N, cp.float32), cp.zeros(N, cp.float32)
        a2, b2 = cp.zeros(N, cp.float32), cp.zeros(N, cp.float32)
        host = np.zeros(4, np.float32)

        def check(name: str, i: int, got: Any, want: float) -> None:
            nonlocal cases
            cases += 1
            if not bool((got == want).all()):
                bad.append((name, i, float(got[0]), float(got[-1]), want))

        if me < 2:
            # 1. ping-pong: rank 0 sends a, rank 1 answers with a + 1
            for i in range(300):
                if me == 0:
                    a.fill(i)
                    comm.Send(a, 1, tag=1)
                    comm.Recv(b, 1, tag=1)
                    check("pingpong", i, b, i + 1)
                else:
                    comm.Recv(b, 0, tag=1)
                    check("pingpong in", i, b, i)
                    a.fill(i + 1)
                    comm.Send(a, 0, tag=1)
            # 2. a host message of the same tag between device ones: the order of sending holds
            for i in range(40):
                if me == 0:
                    a.fill(1000 + i)
                    comm.Send(a, 1, tag=2)
                    host[:] = 2000 + i
                    comm.Send(host, 1, tag=2)
                    comm.Recv(b, 1, tag=2)
                    check("after host", i, b, 3000 + i)
                else:
                    comm.Recv(b, 0, tag=2)
                    check("device before host", i, b, 1000 + i)
                    got = np.zeros(4, np.float32)
                    comm.Recv(got, 0, tag=2)
                    check("host after device", i, got, 2000 + i)
                    a.fill(3000 + i)
                    comm.Send(a, 0, tag=2)
            # 3. two send buffers alternating under one tag, and two receives posted ahead in order
            for i in range(40):
                src = a if i % 2 == 0 else a2
                if me == 0:
                    src.fill(4000 + i)
                    comm.Send(src, 1, tag=3)
                    a2.fill(5000 + i)
                    a.fill(6000 + i)
                    comm.Send(a2, 1, tag=3)
                    comm.Send(a, 1, tag=3)
                    comm.Recv(b, 1, tag=3)
                    check("alternating back", i, b, 7000 + i)
                else:
                    comm.Recv(b, 0, tag=3)
                    check("alternating", i, b, 4000 + i)
                    r1, r2 = comm.Irecv(b, 0, tag=3), comm.Irecv(b2, 0, tag=3)
                    r1.Wait()
                    r2.Wait()
                    check("first posted gets first sent", i, b, 5000 + i)
                    check("second posted gets second sent", i, b2, 6000 + i)
                    a.fill(7000 + i)
                    comm.Send(a, 0, tag=3)
            # 4. a wildcard receive between repeated ones
            for i in range(20):
                if me == 0:
                    a.fill(8000 + i)
                    comm.Send(a, 1, tag=4)
                    comm.Send(a, 1, tag=4)
                    comm.Recv(b, 1, tag=4)
                    check("wildcard back", i, b, 8500 + i)
                else:
                    comm.Recv(b, 0, tag=4)
                    check("specific", i, b, 8000 + i)
                    b.fill(-1)
                    comm.Recv(b, shmproxy.ANY_SOURCE, tag=4)
                    check("wildcard", i, b, 8000 + i)
                    a.fill(8500 + i)
                    comm.Send(a, 0, tag=4)
            # 5. an armed receive cancelled: the message goes to the next receive
            for i in range(10):
                if me == 1:
                    comm.Recv(b, 0, tag=5)
                    check("before cancel", i, b, 9000 + i)
                    r = comm.Irecv(b, 0, tag=5)
                    r.Cancel()
                    r.Wait()
                    comm.Send(host, 0, tag=6)   # rank 0 sends only now
                    b2.fill(-1)
                    comm.Recv(b2, 0, tag=5)
                    check("after cancel", i, b2, 9100 + i)
                else:
                    a.fill(9000 + i)
                    comm.Send(a, 1, tag=5)
                    comm.Recv(host, 1, tag=6)
                    a.fill(9100 + i)
                    comm.Send(a, 1, tag=5)
            # 6. a probe for a message a route may hold out of matching, before its receive: it sees
            # it (a hidden one would hang a blocking probe); then the receive after a sleep of the
            # receiver's, so that the send came alone, and Iprobe finding it
            for i in range(20):
                if me == 0:
                    a.fill(9500 + i)
                    comm.Send(a, 1, tag=7)
                    comm.Recv(host, 1, tag=6)
                else:
                    if i % 2:
                        st = comm.Probe(0, tag=7)
                    else:
                        time.sleep(0.002)
                        st = comm.Iprobe(0, tag=7)
                    cases += 1
                    if st is None or st.source != 0 or st.tag != 7:
                        bad.append(("probe", i, None if st is None else (st.source, st.tag)))
                    comm.Recv(b, 0, tag=7)
                    check("after probe", i, b, 9500 + i)
                    comm.Send(host, 0, tag=6)
            cp.cuda.get_current_stream().synchronize()
        comm.Barrier()
        state = _dumped_state(comm) if me == 0 else None
        comm.Barrier()
    return {"bad": bad, "cases": cases, "armed": state["armed_routes"] if state else None,
            "gpus": state["gpus"] if state else None}
