"""Fault injection for the processes launcher's children (tests only).

A test puts this folder first on PYTHONPATH and sets HEADRACE_TEST_FAULT to
`module:Class.method:after`; every process of the run (supervisor, learner, actors: they are
spawned, so monkeypatching the test's process cannot reach them) then wraps that method, once its
module is imported, so that calls after the first `after` raise RuntimeError("injected fault").
"""

import importlib.abc
import importlib.util
import os
import sys


def failing(original, what: str, after: int):
    calls = 0

    def wrapper(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls > after:
            raise RuntimeError(f"injected fault in {what} (call {calls})")
        return original(*args, **kwargs)

    return wrapper


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, module: str, attribute: str, after: int):
        self.module, self.attribute, self.after = module, attribute, after

    def find_spec(self, name, path, target=None):
        if name != self.module:
            return None
        sys.meta_path.remove(self)  # find the real module once, then wrap it after it runs
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module
        owner_name, method = self.attribute.split(".")

        def exec_module(module):
            load(module)
            owner = getattr(module, owner_name)
            setattr(owner, method, failing(getattr(owner, method), self.attribute, self.after))

        spec.loader.exec_module = exec_module
        return spec


_spec = os.environ.get("HEADRACE_TEST_FAULT")
if _spec:
    _module, _attribute, _after = _spec.split(":")
    sys.meta_path.insert(0, _AfterImport(_module, _attribute, int(_after)))
