"""A blocking environment whose next `to_hang` instances hang in their first reset (until the
test sets `release`); every instance records its calls and any call that overlaps another."""

import threading

from headrace.env.base import Env, EnvSpec

WORDS = ("go", "a", "b", "ok")


class HangingResetEnv(Env):
    spec = EnvSpec(vocabulary=WORDS, action_words=("a", "b"), max_turns=2)
    blocking = True
    to_hang = 0  # set by the test: how many of the next instances hang
    release = threading.Event()
    instances: list["HangingResetEnv"] = []
    overlaps: list[tuple[int, str]] = []

    def __init__(self):
        self.hangs = HangingResetEnv.to_hang > 0
        HangingResetEnv.to_hang -= self.hangs
        self.calls: list[str] = []
        self._busy = threading.Lock()
        HangingResetEnv.instances.append(self)

    def _enter(self, what: str) -> None:
        self.calls.append(what)
        if not self._busy.acquire(blocking=False):
            HangingResetEnv.overlaps.append((HangingResetEnv.instances.index(self), what))
            self._busy.acquire()

    def reset(self, seed):
        self._enter("reset")
        try:
            if self.hangs and len(self.calls) == 1:
                HangingResetEnv.release.wait(120)
            return "go", {}
        finally:
            self._busy.release()

    def step(self, action):
        self._enter("step")
        try:
            return "ok", 1.0, True, False, {"success": True}
        finally:
            self._busy.release()
