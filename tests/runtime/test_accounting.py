"""`headrace.runtime.accounting.identity`: the identity holds exactly only when nothing is lost,
nothing is trained twice, the parts are disjoint and add up to what was written."""

from headrace.runtime.accounting import identity


def result(**changes):
    base = {"written": {"a", "b", "c", "d", "e"}, "trained": {"a", "b"},
            "dropped_by_reason": {"lag": {"c"}}, "quarantined": set(), "in_buffer": {"d", "e"},
            "missing": set(), "trained_twice": set(), "unrecorded": set()}
    return {**base, **changes}


def test_a_sound_run_is_exact_and_counted():
    counts = identity(result())
    assert counts == {"written": 5, "trained": 2, "dropped": {"lag": 1}, "quarantined": 0,
                      "in_buffer": 2, "lost": 0, "trained_twice": 0, "unrecorded": 0,
                      "identity_exact": True}


def test_a_handled_group_still_pending_counts_once():
    """Crash between a checkpoint and its acknowledgement: trained, and still pending."""
    counts = identity(result(in_buffer={"a", "d", "e"}))
    assert counts["in_buffer"] == 2 and counts["identity_exact"]


def test_each_broken_promise_breaks_the_identity():
    assert not identity(result(in_buffer={"d"}, missing={"e"}))["identity_exact"]  # lost
    twice = identity(result(trained_twice={"a"}))
    assert twice["trained_twice"] == 1 and not twice["identity_exact"]
    both = identity(result(dropped_by_reason={"lag": {"a", "c"}}))  # trained and dropped
    assert not both["identity_exact"]
    assert not identity(result(unrecorded={"z"}, in_buffer={"d", "e", "z"}))["identity_exact"]
    assert not identity(result(written={"a", "b", "c", "d"}))["identity_exact"]  # more seen
