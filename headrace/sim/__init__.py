"""The discrete-event simulation of the pipeline behind `headrace simulate` (docs/simulation.md).

- `spec`: the `SimSpec` tree (actors, buffer, learner, staleness) and its YAML loading.
- `trace`: what one run observes, and the weight versions each actor holds.
- `actors`: how long a group takes (per episode, or aggregated for large pools).
- `pipeline`: admission, the bounded buffer, the learner's reader, gate and loop.
- `simulate`: the report of a run, sweeps over the actor pool, the plot, the command line.

It imports only `headrace.config`: the audit (`headrace.audit`) drives it with measured
distributions. Importing this package imports no submodule.
"""
