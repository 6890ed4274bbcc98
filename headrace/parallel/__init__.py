"""Sharding the learner over a named device mesh (data, fsdp, tensor); see docs/sharding.md.

- `mesh`: the mesh from `config.parallel.mesh` (built on demand, nothing at import).
- `rules`: the one partition-rule table (parameter path -> axes per dimension), its application
  to parameters and optimizer state, the replication check, bytes per device.
- `forward`: the transformer's forward pass inside `jax.shard_map` with explicit collectives.
- `step`: `ShardedTrainStep`, the learner step with `train_step.TrainStep`'s interface.

Importing this package imports no submodule and touches no device.
"""
