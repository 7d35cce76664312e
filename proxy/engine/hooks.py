"""Poll hooks: the work a component defers to the loop's next passes, run only while it has some.

MPICH's progress engine calls the hooks its subsystems register (``MPIR_Progress_hook_register``) and
activate while they have pending work (``MPIR_Progress_hook_activate``); so does ours. A component
registers its poll once, at construction, and arms it when it defers something: the fast path when a
slow send waits behind a cell being taken or a drain must be tried again, completion when a wake-up
was relayed to a keep-awake guard that may not run, point-to-point when a send waits out its
buffering grace. The loop runs the armed polls once a pass (``run``); a poll returns whether it still
has work, and is disarmed when it has none. A pass with nothing armed costs one test. A poll that
moved bytes or requests says so itself (``engine.progressed``); being armed does not keep the loop
awake, but a hook registered ``no_sleep`` does, while armed: the loop then looks for posts without
sleeping (``fetch_mode``), and never waits on watched words (engine/fetching.py) while any hook is
armed. News from other threads is not a hook: it comes as events (``post_event``, ``on_events``).
"""
from __future__ import annotations

from typing import Callable


class Hook:
    __slots__ = ("name", "poll", "no_sleep", "armed")

    def __init__(self, name: str, poll: Callable[[], bool], no_sleep: bool):
        self.name = name
        self.poll = poll            # runs the deferred work; True while some is left
        self.no_sleep = no_sleep    # while armed, the loop never sleeps
        self.armed = False


class PollHooks:
    """The armed hooks, in arming order."""

    def __init__(self) -> None:
        self.armed: list[Hook] = []
        self.no_sleep = False       # some armed hook is no_sleep

    def register(self, name: str, poll: Callable[[], bool], no_sleep: bool = False) -> Hook:
        return Hook(name, poll, no_sleep)

    def arm(self, hook: Hook) -> None:
        """The hook's component deferred work: run its poll from the next pass on."""
        if not hook.armed:
            hook.armed = True
            self.armed.append(hook)
            self.no_sleep = self.no_sleep or hook.no_sleep

    def run(self) -> None:
        """The loop, once a pass: every armed poll; one with work left stays armed. A poll may arm
        hooks itself (its own, or another component's): those run from the next pass on."""
        armed, self.armed, self.no_sleep = self.armed, [], False
        for hook in armed:
            hook.armed = False
        for hook in armed:
            if hook.poll():
                self.arm(hook)

    def describe(self) -> list[str]:
        """The armed hooks' names (the dump)."""
        return [h.name for h in self.armed]
