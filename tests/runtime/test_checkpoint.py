"""Learner checkpoints: exact round trips of NNX params + AdamW state, metadata, pruning, meshes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from headrace.learner.checkpoint import Checkpointer


class TinyModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.out = nnx.Linear(16, 4, use_bias=False, rngs=rngs)


TX = optax.adamw(1e-2, weight_decay=0.1)


def make_state(step: int) -> dict:
    """A train state whose values depend on `step`, with non-trivial optimizer moments."""
    params = nnx.state(TinyModel(nnx.Rngs(step)), nnx.Param)
    opt_state = TX.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5 + step), params)
    updates, opt_state = TX.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return {"params": params, "opt": opt_state, "step": jnp.asarray(step, jnp.int32)}


def abstract_state() -> dict:
    """The abstract state the learner would build on restart (no arrays allocated)."""
    params = nnx.state(nnx.eval_shape(lambda: TinyModel(nnx.Rngs(0))), nnx.Param)
    return {"params": params, "opt": jax.eval_shape(TX.init, params),
            "step": jax.ShapeDtypeStruct((), jnp.int32)}


def assert_trees_equal(actual, expected) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.fixture
def open_checkpointer(tmp_path):
    opened: list[Checkpointer] = []

    def open_(keep: int = 3) -> Checkpointer:
        checkpointer = Checkpointer(tmp_path / "checkpoints", keep=keep)
        opened.append(checkpointer)
        return checkpointer

    try:
        yield open_
    finally:
        for checkpointer in opened:
            checkpointer.close()


METADATA = {"learner_step": 7, "weights_version": 3, "trained_ids": ["1700-0", "1700-1"],
            "dropped": {"lag": 2, "age": 0}, "note": None}


@pytest.mark.timeout(120)
def test_round_trip_is_exact(open_checkpointer):
    checkpointer = open_checkpointer()
    assert checkpointer.latest_step() is None
    state = make_state(7)
    checkpointer.save(7, state, METADATA)
    assert checkpointer.latest_step() == 7
    assert checkpointer.last_save_s > 0
    restored, metadata = checkpointer.restore(abstract_state())
    assert_trees_equal(restored, state)
    assert metadata == METADATA
    assert isinstance(restored["params"], nnx.State)
    model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: TinyModel(nnx.Rngs(0)))),
                      restored["params"])
    np.testing.assert_array_equal(model.out.kernel[...], state["params"]["out"]["kernel"][...])


@pytest.mark.timeout(120)
def test_restores_latest_and_prunes_to_keep(open_checkpointer):
    checkpointer = open_checkpointer(keep=2)
    for step in (1, 2, 3, 4):
        checkpointer.save(step, make_state(step), {**METADATA, "learner_step": step},
                          wait=step % 2 == 0)
    checkpointer.wait()
    assert checkpointer.all_steps() == [3, 4]

    # A restarted learner (a new Checkpointer on the same directory) resumes from the latest.
    resumed = open_checkpointer(keep=2)
    assert resumed.latest_step() == 4
    state, metadata = resumed.restore(abstract_state())
    assert_trees_equal(state, make_state(4))
    assert metadata["learner_step"] == 4
    older, metadata = resumed.restore(abstract_state(), step=3)
    assert_trees_equal(older, make_state(3))
    assert resumed.read_metadata(3)["learner_step"] == 3
    with pytest.raises(FileNotFoundError, match=r"kept steps: \[3, 4\]"):
        resumed.restore(abstract_state(), step=1)


@pytest.mark.timeout(120)
def test_bad_calls_are_refused(open_checkpointer):
    checkpointer = open_checkpointer()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpointer.restore(abstract_state())
    with pytest.raises(ValueError, match="JSON"):
        checkpointer.save(1, make_state(1), {"ids": {1, 2}})
    assert checkpointer.latest_step() is None
    checkpointer.save(5, make_state(5), METADATA)
    with pytest.raises(ValueError, match="not newer"):
        checkpointer.save(5, make_state(5), METADATA)
    with pytest.raises(ValueError, match="not newer"):
        checkpointer.save(4, make_state(4), METADATA)
    wrong = abstract_state()
    wrong["step"] = jax.ShapeDtypeStruct((3,), jnp.int32)
    with pytest.raises(ValueError, match="does not match"):
        checkpointer.restore(wrong)
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(checkpointer.directory, keep=0)


@pytest.mark.timeout(120)
def test_metadata_is_copied_at_save(open_checkpointer):
    checkpointer = open_checkpointer()
    metadata = {"trained_ids": ["a"]}
    checkpointer.save(1, make_state(1), metadata, wait=False)
    metadata["trained_ids"].append("b")  # mutation after save must not reach the checkpoint
    checkpointer.wait()
    assert checkpointer.read_metadata() == {"trained_ids": ["a"]}


@pytest.mark.timeout(120)
def test_a_background_save_keeps_the_values_of_its_call_after_the_state_is_donated(
        open_checkpointer):
    """The learner's next step donates the state right after a background save returns: the
    checkpoint must hold the values as they were at the call."""
    checkpointer = open_checkpointer()
    state = make_state(3)
    expected = jax.tree.map(np.array, state)  # host copies of the values at the call
    checkpointer.save(3, state, METADATA, wait=False)
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 2 + 1, s), donate_argnums=0)
    # XLA may write the output into the donated buffers (whether it does for each leaf varies,
    # e.g. with a program loaded from the compilation cache; a buffer still being copied is
    # not reused): the checkpoint must not see those writes.
    jax.block_until_ready(step(state))
    checkpointer.wait()
    assert not checkpointer.saving()
    restored, _ = checkpointer.restore(abstract_state())
    assert_trees_equal(restored, expected)


@pytest.mark.timeout(120)
@pytest.mark.skipif(jax.device_count() < 2, reason="needs >= 2 (simulated) devices")
def test_restore_onto_a_different_mesh(open_checkpointer):
    checkpointer = open_checkpointer()
    state = make_state(2)
    checkpointer.save(2, state, METADATA)  # written from single-device arrays

    n = 2 if jax.device_count() < 4 else 4
    mesh = jax.make_mesh((n,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))

    def target(leaf):
        spec = P("fsdp") if leaf.ndim and leaf.shape[0] % n == 0 else P()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    abstract = jax.tree.map(target, abstract_state())
    restored, _ = checkpointer.restore(abstract)
    assert_trees_equal(restored, state)
    for leaf, want in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract), strict=True):
        assert leaf.sharding == want.sharding
    kernel = restored["params"]["hidden"]["kernel"][...]
    assert kernel.sharding.spec == P("fsdp")
    assert len({shard.device for shard in kernel.addressable_shards}) == n


def test_a_read_only_checkpointer_leaves_a_save_in_progress_alone(tmp_path):
    """Opening a live run's checkpoints to look (accounting, resume checks) must not delete the
    temporary directory of the learner's save in progress, as a writing manager's clean-up does."""
    writer = Checkpointer(tmp_path / "ck", keep=3)
    try:
        writer.save(1, make_state(1), {"learner_step": 1})
    finally:
        writer.close()
    in_progress = tmp_path / "ck" / "2.orbax-checkpoint-tmp"
    in_progress.mkdir()
    looker = Checkpointer(tmp_path / "ck", keep=3, read_only=True)
    try:
        assert looker.latest_step() == 1 and looker.read_metadata() == {"learner_step": 1}
    finally:
        looker.close()
    assert in_progress.exists()
    assert Checkpointer(tmp_path / "missing", read_only=True).latest_step() is None
    assert not (tmp_path / "missing").exists()  # looking creates nothing
