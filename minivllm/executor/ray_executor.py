"""The ray executor: one Ray actor per rank, placed with a placement group, so ranks may live on
any node of a Ray cluster (`ray start --head` on one machine, `ray start --address=HEAD:6379` on
the others; the engine runs on a node of that cluster, README "Across nodes").

    engine core ── ray.put(SchedulerOutput) once a step (the object store: shared memory on a
                   node, copied once to each other node) ── RankActor.step(ref) on every rank
    finish: the driver rank's RunnerOutput (every rank's result is awaited, so a rank that
            raised or died is seen at once)

Ray is imported only when this backend is chosen (optional extra `ray`). The engine connects to
the cluster named by RAY_ADDRESS, or to one already initialised in this process (tests use
ray.cluster_utils.Cluster), or else starts a local one. A rank that dies (RayActorError) or
raises (RayTaskError) makes the executor raise ExecutorDeadError; shutdown kills every actor
and removes the placement group.
"""

from __future__ import annotations

import logging
import os
import time

from minivllm.config import EngineConfig
from minivllm.core.interfaces import RunnerOutput, SchedulerOutput
from minivllm.executor.errors import DeathLatch
from minivllm.structured.bitmask import GrammarBitmask

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
POLL_S = 1.0  # how often a waiting executor checks that every actor is still alive
HEALTH_INTERVAL_S = 5.0  # idle health checks (a ping of every actor) at most this often


class RankActor:
    """One rank inside a Ray actor (made a Ray actor class by _actor_class)."""

    def __init__(self, config: EngineConfig, rank: int, cpu_threads: int) -> None:
        self.config, self.rank, self.cpu_threads = config, rank, cpu_threads
        self.worker = None
        self.pending = None

    def address(self) -> tuple[str, int, str, int]:
        """(this node's IP, a free port on it, the node id, the pid): rank 0's makes the rendezvous."""
        import ray

        from minivllm.executor.multiproc import free_port
        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip), ray.get_runtime_context().get_node_id(), os.getpid()

    def start(self, init_method: str) -> int:
        """Join the groups and load this rank's shard; returns the KV blocks its budget holds."""
        from minivllm.executor.worker import Worker
        # Ray gives an actor its GPU as CUDA_VISIBLE_DEVICES: index 0 of what it sees
        self.worker = Worker(self.config, self.rank, init_method, device_index=0, cpu_threads=self.cpu_threads)
        return self.worker.load()

    def init_kv(self, num_blocks: int) -> None:
        self.worker.init_kv(num_blocks)

    def step(self, sched: SchedulerOutput, grammar: GrammarBitmask | None) -> RunnerOutput | None:
        return self.worker.finish(self.worker.launch(sched, grammar))

    def profile(self, action: str, path: str | None) -> None:
        self.worker.profile(action, path)

    def ping(self) -> bool:
        return True

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


def _actor_class(config: EngineConfig):
    import ray
    resources = {"num_gpus": 1} if config.device.startswith("cuda") else {"num_cpus": 1}
    return ray.remote(**resources)(RankActor)


class RayExecutor(DeathLatch):
    _name = "ray executor"

    def __init__(self, config: EngineConfig) -> None:
        import ray
        self.config = config
        p = config.parallel
        self.world_size = p.world_size
        self.driver = (p.pipeline_parallel_size - 1) * p.tensor_parallel_size
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        self._actors: list = []
        self._pg = None
        self._steps: dict[int, list] = {}
        self._launched = 0
        self._last_health = 0.0
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        on_gpu = self.config.device.startswith("cuda")
        bundle = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": 1}
        self._pg = placement_group([bundle] * self.world_size, strategy="PACK")
        if not self._pg.wait(STARTUP_TIMEOUT_S):
            raise RuntimeError(f"the Ray cluster has no room for {self.world_size} ranks of {bundle} "
                               f"(available: {ray.available_resources()})")
        cls = _actor_class(self.config)
        threads = max(1, (os.cpu_count() or 1) // self.world_size)  # (CPU) ranks on one machine share it
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
            self._actors.append(cls.options(scheduling_strategy=strategy).remote(self.config, rank, threads))
        addresses = self._get([a.address.remote() for a in self._actors])
        init_method = f"tcp://{addresses[0][0]}:{addresses[0][1]}"
        self.node_ids = [a[2] for a in addresses]
        self.worker_pids = [a[3] for a in addresses]  # (on their nodes)
        self.num_blocks = min(self._get([a.start.remote(init_method) for a in self._actors]))
        self._get([a.init_kv.remote(self.num_blocks) for a in self._actors])
        logger.info("ray executor: %d ranks on %d node(s), %d KV blocks each", self.world_size,
                    len(set(self.node_ids)), self.num_blocks)

    # ---- steps -------------------------------------------------------------------------------
    def launch(self, sched: SchedulerOutput, grammar: GrammarBitmask | None = None) -> int:
        import ray
        self._raise_if_dead()
        ref = ray.put(sched)  # once: every rank reads the same object
        self._launched += 1
        self._steps[self._launched] = [a.step.remote(ref, grammar) for a in self._actors]
        return self._launched

    def launch_forward(self, sched: SchedulerOutput) -> SchedulerOutput:
        """A constrained step is sent whole once its bitmask is known (see multiproc.py)."""
        return sched

    def launch_sampling(self, forward: SchedulerOutput, grammar: GrammarBitmask | None = None) -> int:
        return self.launch(forward, grammar)

    def finish(self, handle: int) -> RunnerOutput:
        self._raise_if_dead()
        out = self._get(self._steps.pop(handle))[self.driver]
        if out.expert_token_counts is not None:
            self._expert_counts = out.expert_token_counts
        return out

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.finish(self.launch(sched))

    _expert_counts: list[list[int]] | None = None  # the driver's latest, [MoE layers][experts]

    def expert_token_counts(self) -> tuple[int, ...] | None:
        """As MultiprocExecutor's: the driver's counts as last sent with a step's output."""
        if self._expert_counts is None:
            return None
        return tuple(sum(col) for col in zip(*self._expert_counts))

    def expert_token_counts_per_layer(self) -> list[list[int]] | None:
        return self._expert_counts  # as last sent (up to about a second old)

    def start_rank_profiles(self) -> None:
        """Every rank starts a torch-profiler trace (an actor runs its calls in order: after the
        steps already sent)."""
        self._raise_if_dead()
        for a in self._actors:
            a.profile.remote("start", None)

    def stop_rank_profiles(self, paths: list[str]) -> None:
        """Every rank writes its trace to paths[rank] on its own node (not awaited)."""
        self._raise_if_dead()
        for a, path in zip(self._actors, paths):
            a.profile.remote("stop", path)

    def _get(self, refs, timeout_s: float = STARTUP_TIMEOUT_S):
        """ray.get, waiting POLL_S at a time; a dead or failed rank fails the executor."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(refs, timeout=POLL_S)
            except GetTimeoutError:
                if time.monotonic() > deadline:
                    self._fail(f"the ranks did not answer within {timeout_s} s")
            except RayActorError as e:
                self._fail(f"a rank's actor died: {e}")
            except RayTaskError as e:
                self._fail(f"a rank raised: {e}")

    # ---- failure and shutdown ------------------------------------------------------------------
    def check_health(self) -> None:
        self._raise_if_dead()
        now = time.monotonic()
        if now - self._last_health >= HEALTH_INTERVAL_S and not self._steps:
            self._last_health = now
            self._get([a.ping.remote() for a in self._actors], timeout_s=60.0)

    def _stop_ranks(self) -> None:
        self._kill_actors()

    def _kill_actors(self) -> None:
        import ray
        for a in self._actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors = []

    def shutdown(self) -> None:
        import ray
        if not ray.is_initialized():
            return
        self._kill_actors()
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self._pg)
            self._pg = None
        if self._owns_ray:
            ray.shutdown()
