"""Sharding the learner over a named device mesh (data, fsdp, tensor); see docs/sharding.md.

- `mesh`: the mesh from `config.parallel.mesh` (built on demand, nothing at import).
- `rules`: the one partition-rule table (parameter path -> axes per dimension), its application
  to parameters and optimizer state, the replication check, bytes per device.
- `plan`, `multihost`: memory plans per mesh, the processes of a multi-host mesh.

The sharded learner step built on these (`ShardedLayout`, `ShardedTrainStep`) lives with the
learner (`headrace.learner.sharded_forward`, `headrace.learner.sharded_step`): it is a learner
step, and this package sits below the learner.

Importing this package imports no submodule and touches no device.
"""
