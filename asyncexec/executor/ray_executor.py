"""`RayExecutor`: the same ranks and data plane as `MultiProcExecutor`, placed and kept by Ray.

Ray does placement and lifecycle; our own channels carry every step:
1. a placement group with one bundle per rank (`{"CPU": 1}`, or `{"GPU": 1}` on CUDA), strategy
   `ray_placement_strategy`, and one actor per bundle;
2. every actor reports its node; if all share this node (and no `distributed_host` is set) the channels
   are ipc:// with shared-memory tensors, else TCP bound to `distributed_host` (or this node's IP) with
   CURVE, and tensors as zmq frames;
3. each actor's `run` call hosts the worker loop (`asyncexec.worker.proc.serve`) for its whole life; its
   ObjectRef is the liveness sentinel: when it resolves or fails, the rank is dead (`WorkerDiedError`
   with Ray's error text).
Ray's object store is never on the step path, and our messages are never pickled: an actor receives its
`WorkerSpawn` once, as msgpack bytes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from asyncexec.errors import ConfigError, WorkerDiedError
from asyncexec.executor.multiproc import SHUTDOWN_FRAME, SHUTDOWN_GRACE_S, MultiProcExecutor
from asyncexec.messages import WorkerSpawn

__all__ = ["RayExecutor"]

logger = logging.getLogger(__name__)


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ConfigError("executor='ray' needs Ray: pip install 'asyncexec[ray]'") from e
    return ray


class RayWorkerHost:
    """The body of each rank's actor."""

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def run(self, spawn_msg: bytes) -> int:
        from asyncexec.worker.proc import serve_encoded

        return serve_encoded(spawn_msg)


class RayExecutor(MultiProcExecutor):
    """`tensor_parallel_size` Ray actors, one per placement-group bundle."""

    async def _prepare_ranks(self) -> str | None:
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():  # in the caller's thread: Ray's start-up misbehaves off the main thread
            ray.init(address=self.config.ray_address, include_dashboard=False, log_to_driver=False)
        gpu = self.config.device == "cuda"
        bundle = {"GPU": 1} if gpu else {"CPU": 1}
        self._pg = placement_group([bundle] * self.world_size, strategy=self.config.ray_placement_strategy)
        try:
            await asyncio.wait_for(self._pg.ready(), self.config.worker_start_timeout_s)
        except asyncio.TimeoutError:
            raise ConfigError(
                f"Ray could not place {self.world_size} bundles of {bundle} "
                f"({self.config.ray_placement_strategy}) within {self.config.worker_start_timeout_s:g} s"
            ) from None
        host_cls = ray.remote(RayWorkerHost)
        self._actors = [
            host_cls.options(
                num_cpus=0 if gpu else 1,
                num_gpus=1 if gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=i
                ),
            ).remote()
            for i in range(self.world_size)
        ]
        self._run_refs: list[Any] = []
        self._watchers: list[asyncio.Task[None]] = []
        ips = await asyncio.gather(*(a.node_ip.remote() for a in self._actors))
        here = ray.util.get_node_ip_address()
        logger.info("Ray placed ranks on nodes %s (executor on %s)", ips, here)
        if self.config.distributed_host is None and all(ip == here for ip in ips):
            return None
        return self.config.distributed_host or here

    def _launch(self, rank: int, spawn: WorkerSpawn) -> None:
        ref = self._actors[rank].run.remote(msgspec.msgpack.encode(spawn))
        self._run_refs.append(ref)
        self._watchers.append(
            self._loop.create_task(self._watch(rank, ref), name=f"asyncexec-ray-rank{rank}")
        )

    async def _watch(self, rank: int, ref: Any) -> None:
        try:
            code = await ref
            detail = f"its worker loop returned {code}"
        except Exception as e:  # RayActorError, node failure, ...
            code, detail = None, f"{type(e).__name__}: {e}"
        if not self._closed:
            logger.error("worker rank %d died: %s", rank, detail)
            self._fail(WorkerDiedError(rank, code, detail))

    async def _terminate_workers(self) -> None:
        for rank in range(self.world_size):
            self._channel.send_nowait(rank, SHUTDOWN_FRAME)
        if self._watchers:
            await asyncio.wait(self._watchers, timeout=SHUTDOWN_GRACE_S)

    def _release_ranks(self) -> None:
        ray = import_ray()
        for task in getattr(self, "_watchers", []):
            task.cancel()
        for actor in getattr(self, "_actors", []):
            ray.kill(actor, no_restart=True)
        if getattr(self, "_pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
