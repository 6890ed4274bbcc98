"""The acting loop: a pool of concurrent episodes, grouped per task, written to the buffer.

An actor runs `envs_per_actor / group_size` group slots on one asyncio loop. Each slot repeatedly
takes the next task, plays its G episodes concurrently (their policy calls batched with every other
slot's) and hands the group to the actor's writer (`headrace.actor.writer`), which puts it into
the buffer with any others finished meanwhile; weights are refreshed between turns.

Stopping: `stop` (a threading.Event) ends the loop; episodes in progress are cancelled and their
data, never written, is not counted anywhere. A put that times out is logged, counted
(`actor/put_timeouts`) and retried, so a group is never dropped silently.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from typing import Any

from headrace.actor.cpu import TurnCpu
from headrace.actor.episode import EpisodeResult, run_episode
from headrace.actor.policy import BatchedPolicy, WeightSync
from headrace.actor.writer import GroupWriter
from headrace.buffer.admission import Admission, AdmissionError, Lease
from headrace.buffer.admission_wait import Heartbeat, wait_admit
from headrace.buffer.base import Buffer
from headrace.config import Config
from headrace.engines.base import StoreLoading
from headrace.env.base import Env
from headrace.env.registry import task_seed_start
from headrace.metrics.core import Metrics
from headrace.model.sampler import Sampler
from headrace.text.tokenizers import Tokenizer
from headrace.types import Group, Trajectory
from headrace.weights.base import WeightStore

log = logging.getLogger(__name__)

MAX_THREADS = 512  # blocking environment steps in flight per actor at most
# Leases asked for beyond the slots queued for admission: the slots that finish next take them
# without a round trip (one per group was a quarter of the example's loop), unless they are older
# than SPARE_TTL_S (a group started late on an old forecast would train later than it said).
ADMIT_SPARE = 8
SPARE_TTL_S = 0.25


def to_trajectory(result: EpisodeResult, *, trajectory_id: str, group_id: str, task_id: str,
                  env_name: str, actor_id: str, sampling: dict) -> Trajectory:
    tokens, mask, logps, versions = result.builder.arrays()
    return Trajectory(
        trajectory_id=trajectory_id, group_id=group_id, task_id=task_id, env=env_name,
        actor_id=actor_id, tokens=tokens, loss_mask=mask, behaviour_logprobs=logps,
        policy_version=versions, turns=result.builder.turns, reward=float(result.reward),
        status=result.status, error=result.error, timings=result.timings, sampling=sampling)


def traced(group_id: str, rate: float) -> bool:
    """Whether a group is traced: a stable hash of its id, so every process agrees."""
    return rate > 0 and zlib.crc32(group_id.encode()) < rate * 2**32


class Actor:
    def __init__(self, config: Config, actor_id: str, make_env: Callable[[], Env],
                 tokenizer: Tokenizer, sampler: Sampler, buffer: Buffer, weights: WeightStore,
                 metrics: Metrics, stop: threading.Event, admission: Admission | None = None,
                 loader: Callable[[dict], Any] | None = None):
        self.config = config
        self.loader = loader  # published weights -> params (`WeightSync`); None: as they are
        self.admission = admission
        self.actor_id = actor_id
        self.make_env = make_env
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.buffer = buffer
        self.weights = weights
        self.metrics = metrics
        self.stop = stop
        self._task_seeds = itertools.count(task_seed_start(config.run.seed, actor_id))
        self._id_prefix = uuid.uuid4().hex[:16]  # ids stay unique across actor restarts
        # Admission leases are this process's own: a heartbeat renews every lease of its owner,
        # so an actor restarted under the same id (a resume, a supervisor restart) would keep
        # its killed predecessor's leases alive for good, counted in flight with nothing coming.
        self.lease_owner = f"{actor_id}:{self._id_prefix[:8]}"
        self._group_numbers = itertools.count()
        self._sampling = {"temperature": config.sampling.temperature,
                          "top_k": config.sampling.top_k, "top_p": config.sampling.top_p}
        self._blocked_s = 0.0
        self._in_flight = 0
        # Created on the actor's event loop (`_main`): one slot polls admission, the rest queue.
        self._admit_turn: asyncio.Lock | None = None
        self._installed: asyncio.Event | None = None  # set when new weights are installed
        self._admit_queued = 0  # slots waiting for their turn to be admitted
        self._slots = config.actor.envs_per_actor // config.actor.group_size
        # (lease, monotonic time taken): admitted for slots still queued or about to be (`_admit`)
        self._leases: collections.deque[tuple[Lease, float]] = collections.deque()
        self._p90, self._p90_at = None, float("-inf")  # episode-time p90 for admission, cached
        self._writer: GroupWriter | None = None  # made on the event loop (`_main`)
        self._started = time.monotonic()
        self.discarded = 0  # environments abandoned to a timed-out call (`_replace`)

    def run(self) -> None:
        """Acts until `stop` is set (blocking; run it in its own thread or process).

        Not `asyncio.run`: that joins the executor's threads, and an environment call that timed
        out may never return (`discarded` counts them); the pool is let go without waiting.
        """
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    async def _main(self) -> None:
        actor = self.config.actor
        # Blocking env steps and buffer puts run in this pool: one thread per episode at most.
        pool = concurrent.futures.ThreadPoolExecutor(min(actor.envs_per_actor + 4, MAX_THREADS),
                                                     thread_name_prefix=f"{self.actor_id}-io")
        asyncio.get_running_loop().set_default_executor(pool)
        self._admit_turn = asyncio.Lock()
        self._writer = GroupWriter(self.buffer, self.weights, self.admission, self.metrics,
                                   self.stop, capacity=self.config.buffer.capacity,
                                   put_timeout_s=self.config.buffer.put_timeout_s,
                                   actor_id=self.actor_id)
        loop, installed = asyncio.get_running_loop(), asyncio.Event()
        self._installed = installed

        def on_install(_version: int) -> None:  # on the weights thread
            try:
                loop.call_soon_threadsafe(installed.set)
            except RuntimeError:  # the loop has closed: the actor stopped during the load
                pass

        sync = self._sync = WeightSync(self.weights, self.sampler, self.metrics,
                                       self.config.staleness.forced_lag, loader=self.loader,
                                       on_install=on_install)
        try:
            if not await sync.wait_first(self.stop):  # acts from version 0, once published
                return
            await self._act(sync)
        finally:
            sync.close()
            if isinstance(self.sampler, StoreLoading):  # a server process (maybe still starting)
                self.sampler.close()
            pool.shutdown(wait=False, cancel_futures=True)  # a timed-out call may never return

    async def _act(self, sync: WeightSync) -> None:
        actor = self.config.actor
        if self.config.sampling.precompile:  # before the first episode: none compiles later
            start = time.perf_counter()
            count = await asyncio.to_thread(self.sampler.precompile)
            log.info("actor %s: %d sampler programs compiled in %.1f s", self.actor_id, count,
                     time.perf_counter() - start)
        policy = BatchedPolicy(self.sampler, self.metrics, max_batch=actor.max_batch,
                               wait_s=actor.batch_wait_ms / 1e3, sync=sync)
        # Each slot's environments; a slot replaces one whose call timed out (`_replace`).
        slots = [[self.make_env() for _ in range(actor.group_size)] for _ in range(self._slots)]
        tasks = [asyncio.create_task(policy.serve())]
        tasks += [asyncio.create_task(self._slot(envs, policy)) for envs in slots]
        failures: list[BaseException] = []

        def failed(task: asyncio.Task) -> None:  # a slot or the policy that raised fails the actor
            if not task.cancelled() and task.exception() is not None:
                failures.append(task.exception())

        for task in tasks:
            task.add_done_callback(failed)
        heartbeat = Heartbeat(self.admission, self.lease_owner) if self.admission else None
        if heartbeat is not None:
            heartbeat.start()
        turn_cpu = TurnCpu(prefix=f"{self.actor_id}-io")
        cpu_at, turn_at, wall_at = time.process_time(), turn_cpu.read(), time.monotonic()
        try:
            while not self.stop.is_set():
                await asyncio.sleep(0.05)
                if failures:
                    raise failures[0]
                if time.monotonic() - wall_at >= 2.0:  # this process's CPU use (audit sizing)
                    cpu, turn, wall = time.process_time(), turn_cpu.read(), time.monotonic()
                    self.metrics.gauge("actor/cpu_frac", (cpu - cpu_at) / (wall - wall_at))
                    self.metrics.gauge("actor/turn_cpu_frac", (turn - turn_at) / (wall - wall_at))
                    cpu_at, turn_at, wall_at = cpu, turn, wall
        finally:
            if heartbeat is not None:
                heartbeat.stop()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._release_spare()
            for envs in slots:  # what an environment serves on this loop (a gateway) stops
                for env in envs:
                    if hasattr(env, "aclose"):
                        await env.aclose()
            policy.close()
            for envs in slots:
                for env in envs:
                    env.close()

    async def _slot(self, envs: list[Env], policy: BatchedPolicy) -> None:
        env_cfg = self.config.env
        while not self.stop.is_set():
            requested = time.time()
            lease = await self._admit()
            if lease is None and self.admission is not None:
                return  # stopping
            stamps = {"requested": requested, "admitted": time.time()}
            released = False
            try:
                seed = next(self._task_seeds)
                task_id = f"{env_cfg.name}/{seed}"
                group_id = f"{self._id_prefix}-{next(self._group_numbers)}"
                if traced(group_id, self.config.run.trace_rate):
                    stamps["traced"] = 1.0
                self._in_flight += 1
                self.metrics.gauge("actor/in_flight", self._in_flight)
                per_env = await asyncio.gather(*[
                    self._episode(env, seed, policy, "traced" in stamps) for env in envs])
                results = [result for played in per_env for result in played]
                for result in results:
                    result.timings |= stamps
                await self._replace(envs, per_env)
                if not results:  # agents that made no call (headrace.gateway.runner)
                    self.metrics.count("actor/empty_groups")
                    continue
                group = Group(group_id, task_id, [
                    to_trajectory(r, trajectory_id=f"{group_id}.{j}", group_id=group_id,
                                  task_id=task_id, env_name=env_cfg.name, actor_id=self.actor_id,
                                  sampling=self._sampling) for j, r in enumerate(results)])
                self._record(results)
                with policy.stepping_away():
                    released = await self._put(group, lease)
                if released:  # admitted to written: the sizing hint's time in the pipeline
                    self.metrics.observe("actor/group_s", time.time() - stamps["admitted"])
            finally:
                self._in_flight -= 1
                if lease is not None and not released:  # abandoned: the group was not written
                    self.admission.release(lease)

    def _release_spare(self, stale_only: bool = False) -> None:
        """Releases the spare leases (`_admit`) no slot will start now: all of them (on stop), or
        those older than SPARE_TTL_S."""
        spare, now = [], time.monotonic()
        while self._leases and (not stale_only or now - self._leases[0][1] > SPARE_TTL_S):
            spare.append(self._leases.popleft()[0])
        if not spare:
            return
        self.metrics.count("actor/spare_leases_released", len(spare))
        try:
            self.admission.release_many(spare)  # one round trip
        except AdmissionError as error:  # they expire after lease_ttl_s
            log.warning("actor %s: releasing spare admission leases failed (%s); they expire "
                        "after %.0f s", self.actor_id, error, self.admission.lease_ttl_s)

    async def _episode(self, env: Env, seed: int, policy: BatchedPolicy,
                       trace: bool) -> list[EpisodeResult]:
        """One episode's results: one, or for an environment that runs whole agents (`play`,
        `headrace.gateway.runner`) one per segment of the agent's session (maybe none)."""
        play = getattr(env, "play", None)
        if play is not None:
            return await play(seed, policy, self.tokenizer, self.metrics, trace=trace)
        env_cfg = self.config.env
        return [await run_episode(env, seed, policy, self.tokenizer, self.metrics,
                                  env_cfg.step_timeout_s, trace=trace,
                                  reset_timeout_s=env_cfg.reset_timeout_s)]

    async def _replace(self, envs: list[Env], per_env: list[list[EpisodeResult]]) -> None:
        """Swaps each environment whose call timed out for a fresh one (`env/discarded`).

        The old one is neither reused nor closed: its reset or step may still be running on a
        thread, and neither may be assumed safe to call concurrently. It is left to that thread
        (and the garbage collector) once the call returns.
        """
        for j, results in enumerate(per_env):
            abandoned = [r for r in results if r.abandoned]
            if abandoned:
                envs[j] = await asyncio.to_thread(self.make_env)
                self.discarded += 1
                self.metrics.count("env/discarded")
                log.warning("actor %s: an environment timed out (%s); replaced by a fresh one",
                            self.actor_id, abandoned[0].error)

    async def _admit(self):
        """Waits for admission (docs/design.md, "Admission"); None when there is none, or on stop.

        Slots queue for their turn (first come, first served) and only the slot at the head polls
        the store: hundreds of slots polling at once would spend the actor's core, and the
        store's, on refusals. The head asks for a lease for every slot queued behind it too (one
        round trip for many groups: a round trip per group was a third of the loop's time in the
        example), and ADMIT_SPARE more for the slots that finish next; the slots behind take
        those in turn. Refused for lag, the head sleeps until new weights are installed
        (`_installed`, `wait_admit`'s `wake`): short of dropped or expired groups, nothing else
        lifts such a refusal.
        """
        if self.admission is None:
            return None
        start = time.monotonic()

        def weights_version() -> int:
            # Refused for old weights: newer ones may be out. A failed load is the sampler
            # thread's to raise (its batch fails), not this slot's.
            self._sync.refresh(raise_error=False)
            return self.sampler.version

        def p90_episode_s() -> float | None:  # a quantile costs a sort: once a second is enough
            now = time.monotonic()
            if now - self._p90_at >= 1.0:
                dist = self.metrics.distribution("actor/episode_s")
                self._p90 = (dist.quantiles((0.9,))[0] if dist is not None and dist.count >= 8
                             else None)
                self._p90_at = now
            return self._p90

        self._admit_queued += 1
        queued = True
        try:
            async with self._admit_turn:
                self._admit_queued, queued = self._admit_queued - 1, False
                self._release_spare(stale_only=True)
                if self._leases:
                    lease = self._leases.popleft()[0]
                else:
                    admitted = await wait_admit(
                        self.admission, self.lease_owner, weights_version, stop=self.stop,
                        p90_episode_s=p90_episode_s, poll_s=0.005, max_poll_s=0.05,
                        count=lambda: min(1 + self._admit_queued + ADMIT_SPARE, self._slots),
                        wake=self._installed)
                    lease = admitted.lease
                    taken = time.monotonic()
                    self._leases.extend((more, taken) for more in admitted.more)
        finally:
            if queued:  # cancelled in the queue
                self._admit_queued -= 1
        self.metrics.observe("actor/admission_wait_s", time.monotonic() - start)
        return lease

    def _record(self, results: list[EpisodeResult]) -> None:
        m = self.metrics
        m.count("actor/episodes", len(results))
        m.average_many("reward/mean", [r.reward for r in results])
        m.average_many("reward/success_rate", [float(r.success) for r in results])
        m.average_many("episode/length_mean", [r.builder.length for r in results])
        m.count("actor/generated_tokens", sum(r.builder.generated for r in results))
        m.gauge("actor/weights_version", max((r.builder.newest_version for r in results), default=-1))
        m.observe_many("actor/episode_s", [r.timings["finished"] - r.timings["started"]
                                           for r in results])

    async def _put(self, group: Group, lease: Lease | None) -> bool:
        """Writes the group (`GroupWriter`: with any others finished meanwhile); True once written
        and its admission `lease` (if any) released, False on stop."""
        start = time.perf_counter()
        written = await self._writer.put(group, lease)
        self._blocked_s += time.perf_counter() - start
        self.metrics.gauge("actor/idle_frac",
                           self._blocked_s / self.config.actor.envs_per_actor
                           * self.config.actor.group_size
                           / max(time.monotonic() - self._started, 1e-9))
        return written


