"""`headrace sft CONFIG`: a supervised warm-up on demonstrations, and warm starts from its result.

Demonstrations (`sft.demos`):

- `solver`: the environment's own `solve(seed)` gives the actions of a correct episode for each of
  `sft.episodes` task seeds from `sft.seed_base` on; they are replayed in the environment, so the
  observations (and the reward) are the environment's. An environment without `solve`, or whose
  `solve` raises `NoSolver`/`NotImplementedError`, is refused with the reason; a demonstration
  that does not succeed is skipped and counted (`sft/demo_failures`).
- a JSONL file, one demonstration per line, in either form:
    `{"seed": 7, "actions": ["calc: 37*48", "answer: 1776"]}` replayed in the environment, or
    `{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}` rendered
    as given (a system message may only come first; the first other message is the user's).
  Blank lines and lines starting with `#` are skipped; anything else malformed is an error naming
  the line.

Every demonstration is rendered exactly as the actor renders an episode (the same
`EpisodeRenderer` and chat template), with each action as the tokens the sampler would have to
produce: its encoding plus `<eos>` for open text (decoding stops there), or its single action token
when decoding is constrained to the environment's action words. Those tokens are the loss tokens.
An action the sampler could never produce (longer than `sampling.max_new_tokens`, or not exactly
one allowed token) is an error.

Training reuses the learner's parts: the `Batcher` packs demonstrations into the shape policy's
buckets and the learner's jitted train step runs with loss `none` and every advantage 1, which is
the token-mean negative log-likelihood of the demonstrated tokens (under the sampling temperature
and action constraint, as the learner evaluates the policy). `sft.steps` updates of `sft.batch_size`
demonstrations, AdamW at `sft.lr` (other settings from `learner.optimizer`).

Output, in `sft.dir` (default `runs/sft-{env}-{time}`): config.yaml, metrics.jsonl (`sft/loss`,
`sft/tokens_per_s`, `learner/grad_norm`, `eval/success_rate`, ...), TensorBoard events,
summary.json, and an Orbax checkpoint in `checkpoints/` (the learner's `TrainState`, metadata
`kind: sft`, the model's dims and the text section). Greedy evaluation (the actor's `evaluate`)
runs before training, every `sft.eval_every` updates and at the end.

The job itself (it builds a task and a sampler: the composition root's work) is
`headrace.runtime.sft.run`.

Warm start: `model.init_from: RUN_DIR` makes `headrace train` (and `headrace sft`) start from the
parameters of the newest checkpoint in RUN_DIR/checkpoints, of a warm-up or of a training run (a
fresh optimizer; with `learner.kl_coef` the reference policy is the warm-started one). A folder
that does not exist, holds no checkpoint, or was made with another model or chat template is a
`ConfigError` saying which, raised when the run is built (before any process starts).
"""

from headrace.sft.demos import SftError
from headrace.sft.warm_start import check_init_from, load_init_params

__all__ = ["SftError", "check_init_from", "load_init_params"]
