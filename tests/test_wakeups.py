"""Threads that pin themselves and the wake-up paths between CPUs: the spread copy workers, the
keep-awake guards (shm._workers.KeepAwake), wake_owners, and the relayed wake-ups the progress loop
leaves to the guards and delivers itself when a guard did not."""
from __future__ import annotations

import os
import pathlib
import threading
import time

import numpy as np
import pytest

from shmproxy.shm import _native, pool as P


def _new_thread_state(before: set[int], cpu: int, policy: int | None = None) -> str:
    """The scheduler state (/proc stat: "R", "S", ...) of the one thread this process started since
    ``before`` (thread ids), or "starting" until it has pinned itself to ``cpu`` alone (and taken
    scheduling ``policy``, when given), as the C threads of shm._workers do as they start."""
    import psutil
    tids = [t.id for t in psutil.Process().threads() if t.id not in before]
    if len(tids) != 1 or os.sched_getaffinity(tids[0]) != {cpu} or \
            (policy is not None and os.sched_getscheduler(tids[0]) != policy):
        return "starting"
    return pathlib.Path(f"/proc/self/task/{tids[0]}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_spread_workers_are_pinned_one_per_cpu_and_a_job_leaves_the_one_on_the_callers_cpu_asleep():
    """Workers(spread=True), the crowded node's pool: worker i is pinned to cpus[i] alone, and a job
    queued from a CPU does not wake that CPU's worker (the progress loop runs jobs there itself; a
    worker woken beside it preempted it and left the other CPU idle). wait() wakes any worker, and
    polls first when asked."""
    import psutil
    from shmproxy.shm import _workers
    cpu = sorted(os.sched_getaffinity(0))[0]
    mine = os.sched_getaffinity(0)
    before = {t.id for t in psutil.Process().threads()}
    pool = _workers.Workers(1, [cpu], True)

    def worker_state() -> str:
        return _new_thread_state(before, cpu)

    a, b = np.arange(1 << 16, dtype=np.uint8), np.zeros(1 << 16, np.uint8)
    try:
        os.sched_setaffinity(0, {cpu})       # this thread only: the worker's CPU
        deadline = time.monotonic() + 10
        while worker_state() != "S" and time.monotonic() < deadline:
            time.sleep(0.002)                # started, pinned, asleep on its condvar
        assert worker_state() == "S"
        pool.copy("here", b.ctypes.data, a.ctypes.data, a.nbytes)
        t_end = time.monotonic() + 0.05
        while time.monotonic() < t_end:      # not woken: the job stays queued, the worker asleep
            assert pool.pending == 1 and worker_state() == "S" and not b.any()
            time.sleep(0.005)
        assert pool.wait(10.0, 0.001) is True          # wait() wakes it; poll first, then sleep
        assert pool.drain() == ["here"] and pool.pending == 0
        np.testing.assert_array_equal(a, b)
        with pytest.raises(TypeError):
            pool.wait()
    finally:
        os.sched_setaffinity(0, mine)
        pool.stop()
    with pytest.raises(ValueError, match="spread"):
        _workers.Workers(1, None, True)


def test_keep_awake_guards_are_idle_priority_one_per_cpu_and_sleep_after_their_window():
    """shm._workers.KeepAwake: a SCHED_IDLE guard pinned to each CPU given; touch() opens a window
    in which they spin, after which they sleep (an idle job costs no CPU); stop() is idempotent."""
    import psutil
    from shmproxy.shm import _workers
    cpus = sorted(os.sched_getaffinity(0))[:2]
    before = {t.id for t in psutil.Process().threads()}
    k = _workers.KeepAwake(cpus, 0.02)
    try:
        assert k.nthreads == len(cpus) and not k.spinning
        deadline = time.monotonic() + 10
        while True:   # the guards name, pin and demote themselves as they start
            guards = [t.id for t in psutil.Process().threads() if t.id not in before]
            names = [pathlib.Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in guards]
            masks = sorted(c for t in guards for c in os.sched_getaffinity(t))
            pols = [os.sched_getscheduler(t) for t in guards]
            if (masks == cpus and pols == [os.SCHED_IDLE] * len(cpus)) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert names == ["shmproxy-awake"] * len(cpus) and masks == cpus, (names, masks)
        assert pols == [os.SCHED_IDLE] * len(cpus), pols
        k.touch()
        assert k.spinning
        time.sleep(0.1)
        assert not k.spinning
        cpu0 = psutil.Process().cpu_times()
        time.sleep(0.3)
        cpu1 = psutil.Process().cpu_times()
        assert (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system) < 0.1   # asleep, not spinning
    finally:
        k.stop()
        k.stop()
    assert k.nthreads == 0
    k.touch()                                   # harmless once stopped
    with pytest.raises(ValueError, match="window"):
        _workers.KeepAwake(cpus, 0)
    with pytest.raises(ValueError, match="cpus"):
        _workers.KeepAwake([], 0.01)


def test_keep_awake_guard_hands_the_cpu_back_to_a_thread_that_yields():
    """A thread that sched_yield()s on a CPU where a guard was just woken gets the CPU back at once.
    A yield is no wake-up, so nothing preempts the idle-priority guard it handed the CPU to: on the
    VM's kernel (6.18, EEVDF) a freshly woken guard kept it for its whole window, which made 1 % of
    the 4 MiB round trips take 1.2-2 ms (the progress loop touches the guards, then yields). The
    guards yield between their pause bursts. Unfixed, every yield here took the window (20 ms)."""
    import psutil
    from shmproxy.shm import _workers
    cpu = sorted(os.sched_getaffinity(0))[0]
    before = {t.id for t in psutil.Process().threads()}
    k = _workers.KeepAwake([cpu], 0.02)
    mine = os.sched_getaffinity(0)

    def guard_state() -> str:
        return _new_thread_state(before, cpu, os.SCHED_IDLE)   # it pins and demotes itself as it starts

    gaps = []
    try:
        os.sched_setaffinity(0, {cpu})       # this thread only, beside the guard
        for _ in range(12):
            deadline = time.monotonic() + 10
            while guard_state() != "S" and time.monotonic() < deadline:
                time.sleep(0.002)            # until its window ran out and it sleeps on its condvar
            k.touch()                        # wakes it (idle priority: it does not preempt us)
            t0 = time.perf_counter_ns()
            os.sched_yield()
            gaps.append(time.perf_counter_ns() - t0)
    finally:
        os.sched_setaffinity(0, mine)
        k.stop()
    gaps.sort()
    assert gaps[len(gaps) // 2] < 2_000_000, f"median yield {gaps[len(gaps) // 2] / 1e3:.0f} us: {gaps}"


def _two_cpus() -> tuple[int, int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: the guard's and the waker's")
    return cpus[0], cpus[1]


def _sleeper_on(cpu: int, area: np.ndarray, results: list) -> threading.Thread:
    """A thread pinned to ``cpu`` that sleeps on a rank area's futex word as a rank does (comm.py,
    _sleep_slice: WAITING = (CPU + 1) | word << 32), for at most 10 s; appends how long it slept."""
    wake_addr = area.ctypes.data + 8 * P.RANK_WAKE

    def sleep() -> None:
        os.sched_setaffinity(0, {cpu})
        word = int(area.view(np.uint32)[2 * P.RANK_WAKE])
        area[P.RANK_WAITING] = P.waiting_value(_native.getcpu(), word)
        t0 = time.monotonic()
        _native.futex_wait(wake_addr, word, 10.0)
        area[P.RANK_WAITING] = 0
        results.append(time.monotonic() - t0)
    t = threading.Thread(target=sleep, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not area[P.RANK_WAITING] and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)   # into the futex
    return t


def test_wake_owners_bumps_every_word_and_wakes_sleepers_but_not_relayed_ones():
    """_native.wake_owners (the wake-ups of ProgressEngine.wake_ranks and of complete_coll): every
    owner's futex word moves by one; a rank that said it sleeps is woken, unless its CPU's bit is set
    in ``relayed`` (its guard's job); a negative rank is refused before anything is touched."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    per = P.RANK_AREA_BYTES // 8
    areas = np.zeros(3 * per, np.uint64)
    words = areas.view(np.uint32)[2 * P.RANK_WAKE::2 * per]

    slept: list = []
    sleeper = _sleeper_on(cpu, areas[per:2 * per], slept)
    _native.wake_owners(areas.ctypes.data, 0, (1,), 1 << cpu)      # relayed: bumped, left asleep
    assert list(words) == [0, 1, 0]
    time.sleep(0.2)                                                  # a wrong wake-up would land here
    assert sleeper.is_alive() and not slept
    _native.futex_wake(areas.ctypes.data + 8 * (per + P.RANK_WAKE), 1)   # as the guard would
    sleeper.join(10)
    assert slept and slept[0] < 5

    sleeper = _sleeper_on(cpu, areas[per:2 * per], slept)
    _native.wake_owners(areas.ctypes.data, 0, [0, 1, 2])
    sleeper.join(10)
    assert len(slept) == 2 and slept[1] < 5 and list(words) == [1, 2, 1]
    with pytest.raises(ValueError, match="negative"):
        _native.wake_owners(areas.ctypes.data, 0, (2, -1))
    assert list(words) == [1, 2, 1]


def test_keep_awake_guard_wakes_a_rank_asleep_on_its_cpu_so_the_waker_needs_no_ipi():
    """"Relayed wake-ups" (shm/_workers.c): a live guard wakes the ranks that sleep on its CPU once
    their futex word moved, so a waker on another CPU only bumps the word (live_mask tells it which
    CPUs those are; never its own). A wake-up sent from another vCPU cost the waker ~12 us and the
    wakee ~23 us on the VM. Broken, the sleeper here would sleep its whole 10 s."""
    from shmproxy.shm import _workers
    guard_cpu, my_cpu = _two_cpus()
    mine = os.sched_getaffinity(0)
    area = np.zeros(P.RANK_AREA_BYTES // 8, np.uint64)
    k = _workers.KeepAwake([guard_cpu], 1.0, None, area.ctypes.data, 1)
    slept: list = []
    try:
        os.sched_setaffinity(0, {my_cpu})
        sleeper = _sleeper_on(guard_cpu, area, slept)
        deadline = time.monotonic() + 10
        mask = 0
        while not mask and time.monotonic() < deadline:
            k.touch()   # again each time: a test process descheduled past the 1 s window finds it shut
            time.sleep(0.001)
            mask = k.live_mask()
        assert mask == 1 << guard_cpu
        k.touch()
        _native.fetch_add_u32(area.ctypes.data + 8 * P.RANK_WAKE, 1)   # a completion, no wake-up
        sleeper.join(10)
        assert slept and slept[0] < 5, slept
    finally:
        os.sched_setaffinity(0, mine)
        k.stop()
    assert k.live_mask() == 0      # stopped guards wake nobody: the waker does it again


def test_keep_awake_guard_wakes_the_spread_workers_pinned_to_its_cpu():
    """A job queued while a live guard runs on its worker's CPU wakes no worker from the queueing
    thread: the guard does, locally. Broken, the worker would never be woken (wait() leaves it to
    the guard too) and the job would not finish."""
    from shmproxy.shm import _workers
    guard_cpu, my_cpu = _two_cpus()
    mine = os.sched_getaffinity(0)
    pool = _workers.Workers(1, [guard_cpu], True)
    area = np.zeros(P.RANK_AREA_BYTES // 8, np.uint64)
    k = _workers.KeepAwake([guard_cpu], 1.0, pool, area.ctypes.data, 1)
    src = np.arange(1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    try:
        os.sched_setaffinity(0, {my_cpu})
        k.touch()
        deadline = time.monotonic() + 10
        while not k.live_mask() and time.monotonic() < deadline:
            time.sleep(0.001)
        for i in range(20):
            dst[:] = 0
            pool.copy(i, dst.ctypes.data, src.ctypes.data, src.nbytes)
            assert pool.wait(5.0), f"job {i} did not finish"
            assert pool.drain() == [i] and np.array_equal(dst, src)
        with pytest.raises(RuntimeError, match="already has guards"):
            _workers.KeepAwake([guard_cpu], 1.0, pool)
    finally:
        os.sched_setaffinity(0, mine)
        k.stop()
        pool.stop()
    with pytest.raises(TypeError, match="Workers pool"):
        _workers.KeepAwake([guard_cpu], 1.0, object())


def test_a_relayed_wake_up_the_guard_did_not_deliver_is_delivered_by_the_loop():
    """Completion.check_relayed: a rank left to a guard to wake and still asleep on the same word
    after RELAY_GRACE_NS is woken by the loop (a guard preempted just after it proved live); one that
    woke is forgotten."""
    import types
    from shmproxy.engine.completion import Completion
    cpu = sorted(os.sched_getaffinity(0))[0]
    area = np.zeros(P.RANK_AREA_BYTES // 8, np.uint64)
    slept: list = []
    sleeper = _sleeper_on(cpu, area, slept)
    wake_addr = area.ctypes.data + 8 * P.RANK_WAKE
    _native.fetch_add_u32(wake_addr, 1)        # completed; nobody woke it
    eng = types.SimpleNamespace(q=area, relayed=[])
    eng.relayed.append((time.monotonic_ns() + 10**9, P.RANK_WAITING, int(area[P.RANK_WAITING]), wake_addr))
    Completion.check_relayed(eng)          # within its grace: kept, not woken
    assert len(eng.relayed) == 1 and sleeper.is_alive()
    eng.relayed[0] = (0,) + eng.relayed[0][1:]
    Completion.check_relayed(eng)          # late: the loop wakes it itself
    sleeper.join(10)
    assert slept and slept[0] < 5 and eng.relayed == []
    eng.relayed.append((0, P.RANK_WAITING, 12345, wake_addr))
    Completion.check_relayed(eng)          # it woke (WAITING changed): forgotten
    assert eng.relayed == []


def test_the_loop_remembers_only_the_ranks_a_guard_is_to_wake():
    """Completion._note_relayed: after a wake-up left to keep-awake guards (bits of ``relayed``),
    the ranks asleep on such a CPU are remembered for check_relayed; one asleep elsewhere (woken
    directly) or awake is not."""
    import types
    from shmproxy.engine.completion import Completion
    from shmproxy.engine.hooks import PollHooks
    per = P.RANK_AREA_BYTES // 8
    area = np.zeros(3 * per, np.uint64)
    words = [(0, area.ctypes.data + 8 * (r * per + P.RANK_WAKE), r * per + P.RANK_WAITING) for r in range(3)]
    area[P.RANK_WAITING] = P.waiting_value(5, 7)            # rank 0 asleep on CPU 5: a guard's
    area[per + P.RANK_WAITING] = P.waiting_value(6, 7)      # rank 1 asleep on CPU 6: woken directly
    hooks = PollHooks()
    eng = types.SimpleNamespace(q=area, relayed=[], rank_words=words, st=types.SimpleNamespace(hooks=hooks))
    eng.hook = hooks.register("relayed", lambda: Completion.check_relayed(eng))   # rank 2 awake
    Completion._note_relayed(eng, (0, 1, 2), 1 << 5)
    assert [(w, v, a) for _d, w, v, a in eng.relayed] == [(P.RANK_WAITING, P.waiting_value(5, 7), words[0][1])]
    assert hooks.armed == [eng.hook]   # the loop checks it from its next pass
    Completion._note_relayed(eng, (1, 2), 1 << 5)
    assert len(eng.relayed) == 1
