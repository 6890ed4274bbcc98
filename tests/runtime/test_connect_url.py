"""`standalone.connect_url`: the URL a run announces for actors elsewhere. A wildcard bind
address becomes a name others can reach (this machine's, or the Ray node's IP that
`ray_buffer` passes); any other address is kept."""

import socket

import pytest

from headrace.runtime.standalone import connect_url


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_bind_is_announced_as_a_reachable_address(host):
    url = f"redis://headrace:pw@{host}:6390/0"
    assert connect_url(url, host, address="10.1.2.3") == "redis://headrace:pw@10.1.2.3:6390/0"
    assert connect_url(url, host) == f"redis://headrace:pw@{socket.getfqdn()}:6390/0"
    # without a password the address follows the scheme
    assert connect_url(f"redis://{host}:6390/0", host, address="h") == "redis://h:6390/0"


def test_a_named_bind_is_announced_as_it_is():
    url = "redis://headrace:pw@10.0.0.7:6390/0"
    assert connect_url(url, "10.0.0.7", address="10.1.2.3") == url
