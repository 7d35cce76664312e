"""engine/hooks.py: a component's deferred work is polled while armed, and only then."""
from __future__ import annotations

from shmproxy.engine.hooks import PollHooks


def test_an_armed_hook_runs_each_pass_until_it_has_nothing_left():
    hooks = PollHooks()
    left = [3]

    def poll() -> bool:
        left[0] -= 1
        return left[0] > 0

    hook = hooks.register("countdown", poll)
    hooks.run()
    assert left == [3] and not hooks.armed   # registered, never armed: never polled
    hooks.arm(hook)
    hooks.arm(hook)                          # arming twice polls once a pass
    for expect in (2, 1, 0):
        hooks.run()
        assert left == [expect]
    assert not hooks.armed and not hook.armed
    hooks.run()
    assert left == [0]


def test_a_poll_may_arm_another_hook_which_runs_from_the_next_pass():
    hooks = PollHooks()
    ran: list[str] = []
    second = hooks.register("second", lambda: bool(ran.append("second")))
    first = hooks.register("first", lambda: bool(ran.append("first") or hooks.arm(second)))
    hooks.arm(first)
    hooks.run()
    assert ran == ["first"] and hooks.describe() == ["second"]
    hooks.run()
    assert ran == ["first", "second"] and not hooks.armed


def test_no_sleep_holds_only_while_such_a_hook_is_armed():
    hooks = PollHooks()
    keep = [True]
    quiet = hooks.register("quiet", lambda: True)
    eager = hooks.register("eager", lambda: keep[0], no_sleep=True)
    hooks.arm(quiet)
    assert not hooks.no_sleep
    hooks.arm(eager)
    assert hooks.no_sleep
    hooks.run()
    assert hooks.no_sleep
    keep[0] = False
    hooks.run()
    assert not hooks.no_sleep and hooks.describe() == ["quiet"]
