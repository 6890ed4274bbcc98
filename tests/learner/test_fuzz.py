"""Fuzz: mutated entries through decode -> gate -> batcher -> train step never crash, hang, poison
the weights or go unaccounted.

Property-based (hypothesis, derandomized: the same entries every run). Each example writes
ENTRIES_PER_EXAMPLE entries to the in-memory buffer (which stores bytes and decodes them as the
Redis backend does, with the same `serialize.decode`): valid groups of varied lengths, rewards and
token ids (some past the model's vocabulary, some rewards large enough to overflow the gradient)
and mutations of them: a field set to a value of another type or a non-finite number, a key
deleted or added, the bytes cut short, flipped, or replaced by garbage. The learner's path then
runs as the learner loop runs it: `get` (decode, quarantine), the learner's admission (token ids
against the vocabulary, quarantined through the buffer; the staleness gate), the batcher over
every group that passed, one train step over them all, and the acknowledgement.

Per example: every entry is accounted for exactly (written = trained + dropped + quarantined),
the per-reason quarantine counts add up, every unmutated valid entry is delivered (validation
refuses nothing good) and quarantined only for an id past the vocabulary, and the weights stay
finite. At the end: at least 10,000 entries tried, and every path taken (trained, dropped for age,
quarantined, an update skipped as non-finite). About 30 s on two loaded cores, most of it the one
compile of the train step (one shape: 8 rows x 64).
"""

from __future__ import annotations

import math

import jax
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from headrace.buffer.memory import MemoryBuffer
from headrace.buffer.serialize import QUARANTINE_REASONS, MalformedEntry, check_tokens, encode
from headrace.config import LearnerConfig, LossConfig, ShapesConfig, StalenessConfig
from headrace.learner.batching import Batcher
from headrace.learner.gate import StalenessGate
from headrace.learner.train_step import SKIPPED, init_state, make_optimizer, make_train_step
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.model.transformer import ModelDims
from headrace.types import Group, Trajectory, Turn

EXAMPLES, ENTRIES_PER_EXAMPLE = 100, 100  # 10,000 entries
DIMS = ModelDims(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
BUCKETS = (64,)  # one shape (8 rows x 64): one compile; trajectories are at most 60 tokens
TOKEN_BUDGET = 512
NOW, MAX_AGE_S = 1e9, 100.0  # a group that started 1,000 s before NOW is dropped for age

KINDS = ("valid", "valid", "valid", "set", "set", "delete", "extra", "truncate", "flip",
         "garbage")
PATHS = (
    ("v",), ("group",), ("group", "group_id"), ("group", "task_id"), ("group", "put_version"),
    ("trajectories",), ("trajectories", 0), ("trajectories", 1),
    *(("trajectories", 0, key) for key in (
        "trajectory_id", "group_id", "task_id", "env", "actor_id", "tokens", "loss_mask",
        "behaviour_logprobs", "policy_version", "turns", "reward", "status", "error", "timings",
        "sampling", "schema_version")),
    ("trajectories", 0, "tokens", 0), ("trajectories", 0, "tokens", 1),
    ("trajectories", 0, "tokens", 2), ("trajectories", 1, "behaviour_logprobs", 2),
    ("trajectories", 0, "turns", 0), ("trajectories", 0, "turns", 0, 0),
    ("trajectories", 0, "turns", 1, 3), ("trajectories", 0, "timings", "started"),
)
WEIRD = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf]),
    st.text(max_size=4), st.binary(max_size=8), st.lists(st.integers(-3, 40), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(-2, 2), max_size=2),
)
ENTRY = st.tuples(st.sampled_from(KINDS), st.integers(0, len(PATHS) - 1), WEIRD,
                  st.integers(0, 2**32 - 1))

_tried = {"entries": 0, "trained": 0, "dropped": 0, "quarantined": 0, "steps": 0,
          "skipped_updates": 0}


def _group(rng: np.random.Generator, index: int) -> Group:
    """A valid group: 2-3 trajectories of 3-60 tokens, ids mostly in the vocabulary."""
    gid = f"g{index}"
    out = []
    for j in range(int(rng.integers(2, 4))):
        n = int(rng.integers(3, 61))
        mask = rng.random(n) < 0.6
        tokens = rng.integers(0, DIMS.vocab_size, n).astype(np.int32)
        if rng.random() < 0.05:
            tokens[rng.integers(0, n)] = DIMS.vocab_size + int(rng.integers(0, 3))  # past it
        reward = float(rng.normal()) if rng.random() < 0.997 else float(rng.choice([3e38, -1e300]))
        out.append(Trajectory(
            trajectory_id=f"{gid}.{j}", group_id=gid, task_id=f"t{index}", env="fuzz",
            actor_id="a0", tokens=tokens, loss_mask=mask,
            behaviour_logprobs=np.where(mask, -rng.exponential(2.0, n), 0).astype(np.float32),
            policy_version=np.where(mask, 0, -1).astype(np.int32),
            turns=[Turn(0, n // 2, "user"), Turn(n // 2, n, "assistant", reward)],
            reward=reward, status=str(rng.choice(["ok", "ok", "truncated", "error"])),
            timings={"started": NOW - (1000.0 if rng.random() < 0.05 else 1.0)}))
    return Group(gid, f"t{index}", out, put_version=int(rng.integers(-1, 5)))


def _mutate(data: bytes, kind: str, path: tuple, value, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    if kind == "truncate":
        return data[:int(rng.integers(0, len(data)))]
    if kind == "flip":
        bad = bytearray(data)
        for pos in rng.integers(0, len(bad), int(rng.integers(1, 6))):
            bad[pos] = int(rng.integers(0, 256))
        return bytes(bad)
    if kind == "garbage":
        return rng.bytes(int(rng.integers(0, 64)))
    record = msgpack.unpackb(data, raw=False)
    node = record
    try:
        for key in path[:-1]:
            node = node[key]
        last = path[-1]
        if kind == "set":
            node[last] = value
        elif kind == "delete":
            del node[last]
        else:  # an unknown key next to `last`, in the map that holds it (or in the record)
            (node if isinstance(node, dict) else record)[f"extra_{seed % 7}"] = value
    except (KeyError, IndexError, TypeError):  # the path is not in this record: garbage instead
        return data[::-1]
    return msgpack.packb(record, use_bin_type=True)


@pytest.fixture(scope="module")
def learner_parts():
    graphdef, params = params_lib.init(DIMS, 0)
    config = LearnerConfig(groups_per_batch=1, minibatches=1, token_budget=TOKEN_BUDGET,
                           loss=LossConfig(kind="ppo_clip"), entropy_coef=0.01)
    optimizer = make_optimizer(config.optimizer)
    step = make_train_step(graphdef, config, 1.0, optimizer)
    state = {"train": init_state(jax.device_get(params), optimizer, 0.0)}
    return config, step, state


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # -1e300
def test_fuzzed_entries_never_crash_poison_or_vanish(learner_parts):
    config, step, state = learner_parts
    metrics = Metrics()
    batcher = Batcher(config, ShapesConfig(buckets=BUCKETS), metrics)
    gate = StalenessGate(StalenessConfig(max_policy_lag=3, max_age_s=MAX_AGE_S), metrics)

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              phases=(Phase.generate, Phase.shrink),
              suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**32 - 1),
           entries=st.lists(ENTRY, min_size=ENTRIES_PER_EXAMPLE, max_size=ENTRIES_PER_EXAMPLE))
    def example(seed, entries):
        rng = np.random.default_rng(seed)
        buffer = MemoryBuffer(capacity=10**6, max_pending=10**6, claim_idle_s=3600)
        valid_ids, token_bad = set(), set()
        for index, (kind, path, value, mseed) in enumerate(entries):
            group = _group(rng, index)
            data = encode(group)
            entry_id = buffer.put_raw(data if kind == "valid" else
                                      _mutate(data, kind, PATHS[path], value, mseed))
            if kind == "valid":
                valid_ids.add(entry_id)
                if any(int(t.tokens.max()) >= DIMS.vocab_size for t in group.trajectories):
                    token_bad.add(entry_id)
        delivered = buffer.get(10**6, timeout_s=1.0)  # decode and quarantine, as the reader
        passed, dropped, quarantined_here = [], [], set()
        for entry in delivered:  # the learner's admission (`Learner._admit`)
            try:
                check_tokens(entry.group, DIMS.vocab_size)
            except MalformedEntry as error:
                buffer.quarantine(entry.id, error.reason, str(error))
                quarantined_here.add(entry.id)
                continue
            (dropped if gate.check(entry.group, 0, now=NOW) else passed).append(entry)
        skipped = 0
        if passed:
            batch = batcher.build([e.group for e in passed])
            state["train"], out = step(state["train"], batch)
            if out:  # deliberate sync: the step's metrics and weights, checked here
                skipped = int(out[SKIPPED])
            leaves = jax.tree.leaves(jax.device_get(state["train"].params))
            assert all(np.isfinite(leaf).all() for leaf in leaves), "non-finite weights"
        buffer.ack([e.id for e in passed + dropped])

        stats = buffer.stats()
        quarantined = set(buffer.quarantined)
        # Every entry accounted for, once: trained + dropped + quarantined = written.
        assert len(passed) + len(dropped) + len(quarantined) == len(entries)
        assert {e.id for e in passed + dropped}.isdisjoint(quarantined)
        assert stats["buffer/quarantined"] == len(quarantined) == sum(
            stats[f"buffer/quarantined_{r}"] for r in QUARANTINE_REASONS)
        assert buffer.pending() == 0 and buffer.depth() == 0
        # Validation refuses nothing good: unmutated entries are all delivered, and of them
        # exactly those with an id past the vocabulary are quarantined (by the learner).
        assert valid_ids <= {e.id for e in delivered}
        assert quarantined_here & valid_ids == token_bad
        assert all(buffer.quarantined[i][1] == "token_id" for i in quarantined_here)
        _tried["entries"] += len(entries)
        _tried["trained"] += len(passed)
        _tried["dropped"] += len(dropped)
        _tried["quarantined"] += len(quarantined)
        _tried["steps"] += bool(passed)
        _tried["skipped_updates"] += skipped

    example()
    print(f"fuzz: {_tried}")
    assert _tried["entries"] >= 10_000, _tried
    # The mix exercised every path: training, quarantine and skipped non-finite updates.
    assert _tried["trained"] > 1000 and _tried["quarantined"] > 1000, _tried
    assert _tried["dropped"] > 0, _tried
    assert _tried["skipped_updates"] > 0, _tried
