"""Running a job: the composition root (`build`) and the launchers (`threads`, `processes`, `ray`)."""

from __future__ import annotations

from typing import Any

from headrace.config import Config


def train(config: Config, **kwargs: Any) -> dict[str, Any]:
    """Runs a training job under the launcher `run.launcher` names; returns its summary."""
    if config.run.launcher == "processes":
        from headrace.runtime.processes import train as launch
    elif config.run.launcher == "ray":
        from headrace.runtime.ray_launcher import train as launch
    else:
        from headrace.runtime.threads import train as launch
    return launch(config, **kwargs)
