"""A sharded TrainState saves with Orbax and restores onto its mesh, another mesh shape, or one
device, through `headrace.learner.checkpoint.Checkpointer` as the learner uses it."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from headrace.learner.checkpoint import Checkpointer
from headrace.learner.sharded_step import ShardedTrainStep
from headrace.learner.train_step import init_state, make_optimizer
from headrace.model import params as params_lib
from headrace.parallel import rules
from headrace.parallel.mesh import make_mesh
from tests.parallel.helpers import DIMS, learner_config


def _placed_step(mesh_shape, params, config):
    optimizer = make_optimizer(config.optimizer)
    mesh = make_mesh(dict(zip(("data", "fsdp", "tensor"), mesh_shape)))
    step = ShardedTrainStep(None, config, 1.0, optimizer, mesh=mesh, dims=DIMS)
    return step, step.place(init_state(params, optimizer, config.kl_coef))


def _abstract(state):
    """What the learner builds before restoring: its live state's shapes and shardings."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)


@pytest.mark.timeout(120)
def test_sharded_state_restores_onto_another_mesh_shape(tmp_path):
    config = learner_config("ppo_clip", kl_coef=0.1)
    _, params = params_lib.init(DIMS, 0)
    params = jax.device_get(params)
    step, fresh = _placed_step((1, 4, 2), params, config)
    # Non-trivial values everywhere (optimizer moments, step counters), then sharded.
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda x: (rng.normal(size=x.shape) if x.dtype.kind == "f"
                                   else rng.integers(1, 9, x.shape)).astype(x.dtype),
                        jax.device_get(fresh))
    saved = jax.device_put(host, step.state_shardings)
    whole = sum(x.nbytes for x in jax.tree.leaves(host.params))
    assert rules.max_bytes_per_device(saved.params) < whole / 4
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        checkpointer.save(7, saved, {"learner_step": 7})
    for shape in [(2, 2, 2), (1, 8, 1)]:
        other, target = _placed_step(shape, params, config)
        with Checkpointer(tmp_path / "ckpt") as checkpointer:
            restored, metadata = checkpointer.restore(_abstract(target))
        assert metadata == {"learner_step": 7}
        leaves = zip(jax.tree.leaves(restored), jax.tree.leaves(other.state_shardings),
                     jax.tree.leaves(host))
        for index, (got, want_sharding, value) in enumerate(leaves):
            assert got.sharding.is_equivalent_to(want_sharding, got.ndim), (shape, index)
            np.testing.assert_array_equal(np.asarray(got), value)
        embedding = restored.params["embed"]["embedding"]
        assert rules.max_bytes_per_device(embedding) == embedding.nbytes // (shape[1] * shape[2])
    # The plain single-device learner can read it too (abstract state without shardings).
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        plain, _ = checkpointer.restore(jax.eval_shape(lambda: jax.tree.map(np.asarray, host)))
    for got, value in zip(jax.tree.leaves(plain), jax.tree.leaves(host)):
        np.testing.assert_array_equal(np.asarray(got), value)
