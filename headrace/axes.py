"""The learner mesh's axis names, in mesh order (their meaning: `headrace.parallel.mesh`).

They live below every package so that code which names an axis (a sharding constraint in the
model, a collective in the sampler) imports a constant without importing the mesh machinery.
"""

DATA = "data"
FSDP = "fsdp"
TENSOR = "tensor"
AXES = (DATA, FSDP, TENSOR)
ROW_AXES = (DATA, FSDP)  # a microbatch's rows are split over these (major to minor)
MODEL_AXES = (FSDP, TENSOR)  # parameters are sharded over these
