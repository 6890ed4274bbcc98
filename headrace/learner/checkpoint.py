"""Learner checkpoints: the train state (a PyTree) and a JSON record of the learner's bookkeeping.

A thin layer over Orbax's `CheckpointManager` with two composite items per step:

- `state`: any PyTree of arrays (NNX parameters as `nnx.State`, optax state, step counters), saved
  with `StandardSave` and restored with `StandardRestore` onto an *abstract* state (leaves are
  `jax.ShapeDtypeStruct`, from `jax.eval_shape` or `nnx.eval_shape`). Leaves that carry a sharding
  are restored onto it, so a checkpoint written on one mesh can be read onto another; leaves
  without one land on the default device.
- `metadata`: a JSON object (learner step, weights version, ids of the buffer entries trained on,
  drop counters, ...). JSON rules apply: tuples come back as lists and keys as strings.

Each step is a directory `DIR/<step>/` that Orbax writes under a temporary name and renames when
complete; a crash mid-save leaves the previous steps intact (temporary leftovers are removed when
the next `Checkpointer` opens the directory), and `latest_step()` only ever names complete ones.
The newest `keep` steps are kept.

Crash safety of the learner loop. The learner acknowledges buffer entries only after the checkpoint
whose metadata lists them (and the drop counters) is complete: `save(..., wait=True)` returned, or
`wait()` after `save(..., wait=False)`. A crash between the save and the ack therefore loses
nothing: the restarted learner restores that checkpoint, the buffer redelivers the unacknowledged
entries, and the learner skips the ids its checkpoint says were already trained on. A crash before
the save completes loses only the steps since the previous checkpoint; their entries were not
acknowledged, so they are redelivered and trained on again.

Multi-host learners: every process must call `save`, `restore` and `close` (Orbax synchronises
them and writes each array shard from the process that owns it); the directory must be shared.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

STATE = "state"
METADATA = "metadata"


class _ReadOnlyNotes(logging.Filter):
    """Drops Orbax's two warnings that a read-only manager is read-only (asked for, not news)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("CheckpointManagerOptions.read_only=True",
                                               "Given directory is read only"))


logging.getLogger("absl").addFilter(_ReadOnlyNotes())


class Checkpointer:
    """Saves and restores learner checkpoints in `directory`, keeping the newest `keep` steps.

    Args:
      directory: where step directories go (created if missing).
      keep: checkpoints kept (>= 1); older ones are deleted after each save completes.
      read_only: only look (`latest_step`, `read_metadata`, `restore`): create nothing and, above
        all, leave temporary directories alone, since they may be a live learner's save in
        progress (accounting, resume checks and audits of a running run open it this way).

    Attributes:
      last_save_s: time the last `save` blocked the caller (for `learner/checkpoint_s`); with
        `wait=False` that is the device-to-host copy only, not the write.
      last_restore_s: wall time of the last `restore`.

    Raises:
      ValueError: `keep` < 1.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3, *, read_only: bool = False):
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1")
        self.directory = pathlib.Path(directory).absolute()
        self.keep = keep
        options = ocp.CheckpointManagerOptions(
            preservation_policy=checkpoint_managers.LatestN(keep),
            create=not read_only,
            # A reader (evaluation, a warm start) leaves a save in progress alone.
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            enable_async_checkpointing=not read_only,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=(STATE, METADATA))
        self.last_save_s = float("nan")
        self.last_restore_s = float("nan")

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r}, keep={self.keep})"

    def save(self, step: int, state: Any, metadata: dict, *, wait: bool = True) -> None:
        """Checkpoints `state` and `metadata` as `step`.

        With `wait=False` the call returns once the arrays are copied off the device (donating or
        overwriting device buffers afterwards is safe) and the files are written in the
        background; call `wait()` before acknowledging anything the checkpoint covers. A later
        `save` or `close` waits for the one in flight. Do not mutate NumPy leaves of `state`
        until the write is finished.

        Raises:
          ValueError: `step` is not newer than the latest checkpoint, or `metadata` is not a
            JSON object (str keys; lists, numbers, strings, bools, None as values).
        """
        start = time.perf_counter()
        step = int(step)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(f"checkpoint step {step} is not newer than the latest, {latest}, in "
                             f"{self.directory}")
        metadata = _json_copy(metadata)
        args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                     METADATA: ocp.args.JsonSave(metadata)})
        # force: the learner decides when to checkpoint, not Orbax's save-interval policy.
        saved = self._manager.save(step, args=args, force=True)
        if not saved:
            raise RuntimeError(f"Orbax declined to save step {step} in {self.directory}")
        if wait:
            self._manager.wait_until_finished()
        self.last_save_s = time.perf_counter() - start

    def saving(self) -> bool:
        """Whether a save with `wait=False` is still writing (not blocking)."""
        return self._manager.is_saving_in_progress()

    def wait(self) -> None:
        """Blocks until an asynchronous save is complete on disk (then it is safe to ack)."""
        self._manager.wait_until_finished()

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints kept, oldest first."""
        return sorted(self._manager.all_steps())

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """Reads checkpoint `step` (default: the latest) onto the structure of `abstract_state`.

        Args:
          abstract_state: the state's PyTree with `jax.ShapeDtypeStruct` leaves (optionally with
            shardings: the restored arrays are placed on them), e.g.
            `jax.eval_shape(init_fn)` or `nnx.state(nnx.eval_shape(make_model))`.
          step: which checkpoint; None for the latest.

        Returns:
          (state, metadata): the state with the structure of `abstract_state`, and the JSON
          metadata saved with it.

        Raises:
          FileNotFoundError: no checkpoint exists, or `step` is not kept (the message lists the
            steps that are).
          ValueError: the checkpoint does not match `abstract_state` (Orbax's reason attached).
        """
        start = time.perf_counter()
        step = self._resolve(step)
        # Orbax needs a target sharding for every leaf once the topology differs (a checkpoint
        # of several learner processes read by one): leaves without one go to the default device.
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract_state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=default)
            if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None else x, abstract_state)
        args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract_state),
                                     METADATA: ocp.args.JsonRestore()})
        try:
            restored = self._manager.restore(step, args=args)
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"checkpoint step {step} in {self.directory} does not match the "
                             f"abstract state: {error}") from error
        self.last_restore_s = time.perf_counter() - start
        return restored[STATE], dict(restored[METADATA])

    def read_metadata(self, step: int | None = None) -> dict:
        """The metadata of checkpoint `step` (default: the latest) without reading the state.

        Raises:
          FileNotFoundError: as in `restore`.
        """
        step = self._resolve(step)
        args = ocp.args.Composite(**{METADATA: ocp.args.JsonRestore()})
        return dict(self._manager.restore(step, args=args)[METADATA])

    def close(self) -> None:
        """Waits for a save in flight, then releases Orbax's threads. Idempotent."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step is None:
            return steps[-1]
        if int(step) not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                                    f"kept steps: {steps}")
        return int(step)


def _json_copy(metadata: dict) -> dict:
    """A deep copy of `metadata` through JSON (so later mutation cannot reach the async write)."""
    if not isinstance(metadata, dict):
        raise ValueError(f"checkpoint metadata must be a dict, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(metadata))
    except (TypeError, ValueError) as error:
        raise ValueError(f"checkpoint metadata is not JSON-serialisable: {error}; convert arrays "
                         "with .tolist() and sets to lists") from None
