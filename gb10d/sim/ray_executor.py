"""`--distributed-executor-backend ray`: the EngineCore as Ray driver, one RayWorkerWrapper actor per GPU.

What vLLM's initialize_ray_cluster() and RayDistributedExecutor do, on a
real Ray cluster: connect (`ray.init`, Ray prints its own lines), refuse a
cluster with fewer GPUs than tensor x pipeline parallel size, place one
`{"GPU": 1}` bundle per rank (PACK, the first one on the driver's node) and
wait for the placement, copy the VLLM_* variables and the run's knobs to the
workers, then run the per-GPU steps in the actors.

The actors do what the GPU workers do up to the loaded model: the process
group lines, the free-memory check on the memory of the machine they run on
(GB10D_SIM_TOTAL_GIB / _FREE_GIB / _MEMINFO from the environment that
machine's `ray start` got, which describes that machine), and the weight
loading. Compilation, profiling, KV-cache sizing and graph capture stay in
the driver, printed once, with this rank's share of weights and KV cache:
in vLLM they are per-worker too, but their failures are the driver-side
ones the single-GPU sim already has, so moving them would only multiply
lines. Requests are answered by the driver; the actors are only pinged,
so that the loss of one (its machine left the cluster) ends the engine as
vLLM's Ray executor would end on a RayActorError.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from . import memory, texts
from .engine import EngineFailure
from .model import ModelFacts
from .output import Console, ConsoleStream
from .settings import SettingsError, SimSettings, from_environ
from .worker import GpuWorker, RankInfo, WorkerFailure, init_method

HEALTH_CHECK_S = 1.0  # wall clock: how soon a lost worker is noticed while serving
PG_FIRST_WAIT_S = 10.0  # _wait_until_pg_ready: first wait, doubled after each message
WORKER_LINES_GRACE_S = 5.0  # wall clock: how long the driver waits for a worker's lines to be forwarded
# The message each worker step ends with (GpuWorker).
LAST_LINES = {"init_device": "] Using V2 Model Runner", "load_model": "] Model loading took "}
# Knobs the driver decides for all workers; the memory knobs are each machine's own.
DRIVER_KNOBS = ("GB10D_SIM_SPEED", "GB10D_SIM_SCENARIO", "GB10D_SIM_SHARDS", "GB10D_SIM_ERA", "GB10D_SIM_VERSION")
# vLLM's WORKER_SPECIFIC_ENV_VARS among the VLLM_* ones: never copied.
WORKER_SPECIFIC = ("VLLM_HOST_IP", "VLLM_HOST_PORT")

LogFn = Callable[[str, str], None]  # (source, message): the EngineCore's INFO record


def exception_line(error: BaseException) -> str:
    """The last line Python prints for an exception: `module.Type: message` (builtins unqualified)."""
    kind = type(error)
    module = kind.__module__
    name = kind.__qualname__ if module in ("builtins", "__main__") else f"{module}.{kind.__qualname__}"
    return f"{name}: {error}"


def ray_frames(error: BaseException) -> list[texts.Frame]:
    """The frames of `error`'s traceback inside Ray, moved under the recorded installation's site-packages."""
    frames: list[texts.Frame] = []
    for frame in traceback.extract_tb(error.__traceback__):
        _, marker, rest = frame.filename.partition("/site-packages/ray/")
        if marker:
            frames.append((f"{texts.SITE}/ray/{rest}", frame.lineno or 0, frame.name, frame.line or ""))
    return frames


@dataclass(frozen=True)
class WorkerIdentity:
    """What Ray shows of an actor in a RayTaskError: its process, node, actor id and object address."""

    pid: int
    ip: str
    actor_id: str
    address: int


class RayWorkerWrapper:
    """One rank's GpuWorker in a Ray actor.

    Named as vLLM's class so that Ray's prefix on its forwarded lines reads
    `(RayWorkerWrapper pid=N, ip=A)`; no __repr__, because Ray would put a
    custom one in that prefix instead of the class name. Ray pickles the
    class by reference, so the worker node imports this module from the
    same Python environment.
    """

    def __init__(self) -> None:
        self.worker: GpuWorker | None = None
        self.settings: SimSettings | None = None

    def identity(self) -> WorkerIdentity:
        return WorkerIdentity(os.getpid(), ray.util.get_node_ip_address(), ray.get_runtime_context().get_actor_id() or "", id(self))

    def update_environment_variables(self, env: dict[str, str]) -> None:
        """What the driver copies over this machine's environment (vLLM's update_environment_variables)."""
        os.environ.update(env)

    def init_worker(self, args: argparse.Namespace, model: ModelFacts, rank: RankInfo) -> None:
        """Read the knobs here, after the copy: the memory ones are this machine's; log untagged, Ray prefixes."""
        self.settings = from_environ()
        console = Console(dataclasses.replace(self.settings.style, process_tag=False), "RayWorkerWrapper")
        self.worker = GpuWorker(self.settings, args, model, console, rank)

    def execute_method(self, method: str) -> None:
        """Run a GpuWorker step; a failure is logged here first, as WorkerWrapperBase.execute_method does."""
        assert self.worker is not None and self.settings is not None
        try:
            getattr(self.worker, method)()
        except WorkerFailure as failure:
            self.worker.log(texts.RAY_WORKER_ERROR_SRC, texts.ray_worker_error(method, failure.kind, failure.final), "ERROR")
            memory.trap(self.settings)
            raise

    def ping(self) -> None:
        """Answered while the actor lives; the health check's probe."""


class RayExecutor:
    """The driver side: the cluster, the placement group, one actor per rank, and the ranks' RPCs."""

    health_interval_s = HEALTH_CHECK_S

    def __init__(self, args: argparse.Namespace, model: ModelFacts, log: LogFn, stdout: ConsoleStream) -> None:
        self.log = log
        self.stdout = stdout
        self.world_size = int(args.tensor_parallel_size) * int(args.pipeline_parallel_size)
        self._connect()
        driver_ip = os.environ.get("VLLM_HOST_IP") or ray.util.get_node_ip_address()
        group = self._place(driver_ip)
        copied = self._copied_environment()
        actor = ray.remote(RayWorkerWrapper)
        actors = [
            actor.options(
                num_cpus=0,
                num_gpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_capture_child_tasks=True, placement_group_bundle_index=index),
            ).remote()
            for index in range(self.world_size)
        ]
        identities = self._get("identity", [a.identity.remote() for a in actors])
        # vLLM sorts the workers so that the driver's node comes first.
        order = sorted(range(self.world_size), key=lambda i: (identities[i].ip != driver_ip, identities[i].ip))
        self.workers = [actors[i] for i in order]
        self.identities: list[WorkerIdentity] = [identities[i] for i in order]
        self._get("update_environment_variables", [w.update_environment_variables.remote(copied) for w in self.workers])
        method = init_method(driver_ip, os.getpid())
        ranks = []
        for rank, identity in enumerate(self.identities):
            local_rank = sum(1 for other in self.identities[:rank] if other.ip == identity.ip)
            ranks.append(RankInfo(rank, self.world_size, local_rank, int(args.tensor_parallel_size), method))
        self._get("init_worker", [w.init_worker.remote(args, model, r) for w, r in zip(self.workers, ranks)])
        self._pings: list[Any] = []

    # --- initialize_ray_cluster ------------------------------------------------

    def _connect(self) -> None:
        """ray.init on RAY_ADDRESS (or `auto`), then the GPU count check."""
        try:
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True)
        except Exception as error:
            raise EngineFailure(texts.RAY_ENGINE_FRAMES["connect"] + ray_frames(error), exception_line(error)) from None
        # ray.init made SIGTERM a SystemExit; the EngineCore dies of it while starting, as without Ray.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if ray.cluster_resources().get("GPU", 0) < self.world_size:
            raise EngineFailure(texts.RAY_ENGINE_FRAMES["gpus"], texts.RAY_NOT_ENOUGH_GPUS)

    def _place(self, driver_ip: str) -> PlacementGroup:
        """One GPU bundle per rank, the first on the driver's node; wait as _wait_until_pg_ready does."""
        self.log("v1/executor/ray_utils.py:367", texts.RAY_NO_PLACEMENT_GROUP)
        specs: list[dict[str, float]] = [{"GPU": 1.0} for _ in range(self.world_size)]
        specs[0][f"node:{driver_ip}"] = 0.001
        group = placement_group(specs, strategy="PACK")
        started = time.monotonic()
        ready = group.ready()
        interval = PG_FIRST_WAIT_S
        while time.monotonic() - started < texts.RAY_PG_WAIT_TIMEOUT_S:
            done, _ = ray.wait([ready], timeout=interval)
            if done:
                return group
            interval *= 2
            self.log("v1/executor/ray_utils.py:232", texts.placement_group_waiting(int(time.monotonic() - started), group.bundle_specs))
        raise EngineFailure(texts.RAY_ENGINE_FRAMES["placement"], texts.placement_group_timeout(specs))

    def _copied_environment(self) -> dict[str, str]:
        """VLLM_* (less the worker-specific ones) and the driver's knobs, logged as vLLM logs the copy."""
        copied = {k: v for k, v in os.environ.items() if (k.startswith("VLLM_") and k not in WORKER_SPECIFIC) or k in DRIVER_KNOBS}
        config_root = os.environ.get("VLLM_CONFIG_ROOT") or os.path.expanduser("~/.config/vllm")
        for src, line in texts.ray_env_copy_lines(sorted(k for k in copied if k.startswith("VLLM_")), config_root):
            self.log(src, line)
        return copied

    # --- the ranks -------------------------------------------------------------

    def _get(self, method: str, refs: Sequence[Any]) -> list[Any]:
        """ray.get of one RPC per rank, in rank order; a failure becomes the EngineCore's traceback.

        A worker's own failure was logged by the worker; its lines travel
        through Ray's log forwarding, slower than the exception, so the
        driver gives them a moment to arrive before it prints its traceback
        and exits (a driver that exits first loses them).
        """
        results = []
        for index, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayTaskError as error:
                cause = error.cause
                if isinstance(cause, SettingsError):
                    raise cause from None
                if not isinstance(cause, WorkerFailure):
                    raise
                self.stdout.wait_line(lambda line: "RayWorkerWrapper pid=" in line and "Error executing method" in line, WORKER_LINES_GRACE_S)
                who = self.identities[index]
                final = texts.ray_task_error(cause.kind, cause.final, who.pid, who.ip, who.actor_id, who.address)
                raise EngineFailure(texts.ray_rpc_frames(method) + ray_frames(error), final) from None
            except ray.exceptions.RayError as error:
                raise EngineFailure(texts.ray_rpc_frames(method) + ray_frames(error), exception_line(error)) from None
        return results

    def collective_rpc(self, method: str) -> None:
        """Run the step on every rank, then wait (a little) until its last line has been forwarded.

        So the driver's next lines come after the workers' ones, as in vLLM
        where every one of those lines is a worker's.
        """
        self._get(method, [w.execute_method.remote(method) for w in self.workers])
        last = LAST_LINES[method]
        self.stdout.wait_line(lambda line: "RayWorkerWrapper pid=" in line and last in line, WORKER_LINES_GRACE_S)

    def check_health(self) -> None:
        """Collect the pings that came back (a dead actor's raises), send new ones once all are back; never blocks."""
        if self._pings:
            done, self._pings = ray.wait(self._pings, num_returns=len(self._pings), timeout=0)
            try:
                ray.get(done)
            except ray.exceptions.RayError as error:
                raise EngineFailure(texts.RAY_BUSY_LOOP_FRAMES + ray_frames(error), exception_line(error)) from None
        if not self._pings:
            self._pings = [w.ping.remote() for w in self.workers]

    def shutdown(self) -> None:
        """Disconnect from the cluster, so that Ray removes the actors at once."""
        ray.shutdown()
