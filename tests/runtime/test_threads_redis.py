"""The threads launcher with the Redis buffer (`buffer.backend: redis`, an embedded server): its
in-process admission reads the buffer's counts from Redis, and a short run trains and finishes."""

from __future__ import annotations

import json

import pytest

from tests.runtime.test_failures import SMALL


@pytest.mark.timeout(240)
def test_a_threads_run_on_an_embedded_redis_trains(tmp_path, capsys):
    from headrace.buffer.server import RedisServerError, find_redis_server
    from headrace.cli import main

    try:
        find_redis_server()
    except RedisServerError as error:
        pytest.skip(str(error))
    run_dir = tmp_path / "run"
    small = [a if a != "run.max_steps=100000" else "run.max_steps=3" for a in SMALL]
    code = main(["train", "examples/guess_number.yaml", "--json", "--no-live",
                 "--set", "run.launcher=threads", "--set", "buffer.backend=redis",
                 "--set", f"run.dir={run_dir}", *small, "--set", "run.max_wall_s=0"])
    # max_wall_s off (it counts from this call, but the machine may be loaded): the test's timeout
    # guards a run that would not end at its 3 steps
    summary = json.loads(capsys.readouterr().out)
    assert code == 0, summary
    assert summary["stopped_by"] == "max_steps" and summary["errors"] == [], summary
    assert summary["steps"] == 3
    assert (run_dir / "redis").is_dir()  # the embedded server's folder: Redis was the buffer
