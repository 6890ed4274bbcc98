"""The processes launcher restarts its embedded redis-server when it dies while the run sets up
(the chaos bench killed it under a resumed run's ledger switch, which ended that run with a
traceback): the supervisor's set-up calls retry, and their retries revive the server."""

from __future__ import annotations

import pytest

from headrace.buffer.server import RedisServerError, find_redis_server
from headrace.config import load
from headrace.runtime import build, processes


class _SetUp(Exception):
    """Raised in place of the supervisor: the set-up before it got through."""


@pytest.mark.timeout(120)
def test_a_server_killed_during_set_up_is_restarted_and_the_set_up_goes_on(tmp_path,
                                                                            monkeypatch):
    try:
        find_redis_server()
    except RedisServerError as error:
        pytest.skip(str(error))
    config = load("examples/guess_number.yaml", [
        f"run.dir={tmp_path / 'run'}", "run.ledger=true", "buffer.fsync=always"])
    servers, ledgers = [], []

    def start_buffer(config, run_dir, **kwargs):
        server, config = build.start_embedded_redis(config, run_dir, **kwargs)
        servers.append(server)
        return server, config

    def enable_ledger(client, run_id, shard):
        if not ledgers:
            servers[0].kill()  # a crash: SIGKILL, nothing flushed
        ledgers.append(shard)
        return real_enable_ledger(client, run_id, shard)

    def supervisor(config, run_dir, url, run_id):
        assert servers[0].running  # restarted on its port
        raise _SetUp

    real_enable_ledger = processes.enable_ledger
    monkeypatch.setattr(processes, "enable_ledger", enable_ledger)
    with pytest.raises(_SetUp):
        processes.train(config, live=False, start_buffer=start_buffer, make_supervisor=supervisor)
    assert len(ledgers) >= 2  # the first call failed on the dead server and was retried
    assert not servers[0].running  # and the set-up's failure still stops the server
