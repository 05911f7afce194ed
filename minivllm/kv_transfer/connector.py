"""The KV connector interface of disaggregated prefill/decode, and its registry by name.

One connector lives beside the runner of an engine (the in-process executor: one rank). Every
method is called from the engine's thread; transports run on the connector's own threads.

    producer: register_sends(finished requests' blocks) -> a consumer pulls them -> poll() says
              which were released (pulled, or timed out) -> the scheduler frees those blocks
    consumer: start_pulls(blocks to fill) -> the transport fetches them into a staging buffer ->
              poll() copies what arrived into the KV cache and says which pulls succeeded

Ordering invariant: pulled K/V enters the KV cache only in poll(), on the engine thread, queued on
its compute stream before the step that first reads it is launched (the scheduler schedules a
pulled request only after poll() reported it); a cancelled pull (its request aborted, its blocks
freed) is never applied, since cancel_pulls() comes before the next poll().

Connectors (kv_transfer_config.kv_connector):
- HostConnector (host_connector.py): block bytes over a TCP socket; CPU and GPU.
- CudaIpcConnector (cuda_ipc_connector.py): the producer's KV tensors mapped once through CUDA
  IPC, blocks copied device to device; the host transport when the producer's GPU is not visible.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from minivllm.config import KVTransferConfig
from minivllm.core.interfaces import KVPull, KVSend


@dataclass
class ArrivedPull:
    """A pull's outcome: the blocks (one tensor per pool tensor, [n, block_size, Hkv, D], on the
    host or the device) to copy into `local_block_ids`, or ok False (the prompt is recomputed)."""

    req_id: str
    ok: bool
    local_block_ids: list[int]
    blocks: list[torch.Tensor] | None = None
    error: str | None = None


class KVConnector(ABC):
    def __init__(self, config: KVTransferConfig, pool: list[torch.Tensor]) -> None:
        self.config = config
        self.pool = pool  # the KV cache: per layer K then V, [num_blocks, block_size, Hkv, D]
        self.device = pool[0].device
        self._arrived: list[ArrivedPull] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._cancelled: set[str] = set()
        self._pending: set[str] = set()  # pulls started and not yet reported
        self.server = None  # the producer's BlockServer
        if config.is_producer:
            from minivllm.kv_transfer.block_server import BlockServer
            self.server = BlockServer(pool, config.engine_id, config.kv_ip, config.kv_port, config.send_timeout_s)

    @property
    def address(self) -> tuple[str, str, int] | None:
        """(engine id, host, port) where consumers find this producer's blocks; None: not a producer."""
        if self.server is None:
            return None
        return self.config.engine_id, self.server.host, self.server.port

    # ---- engine side -----------------------------------------------------------------------
    def register_sends(self, sends: list[KVSend]) -> None:
        for s in sends:
            self.server.register(s.req_id, s.block_ids)

    def start_pulls(self, pulls: list[KVPull]) -> None:
        for p in pulls:
            assert len(p.local_block_ids) == len(p.remote_block_ids), "a pull copies block for block"
            self._pending.add(p.req_id)
            self._start_pull(p)

    def cancel_pulls(self, req_ids: list[str]) -> None:
        self._cancelled.update(r for r in req_ids if r in self._pending)

    def poll(self) -> tuple[list[str], dict[str, bool]]:
        """(producer requests whose blocks are released, {consumer request: pull succeeded}).
        Arrived blocks are copied into the KV cache first."""
        sent: list[str] = []
        if self.server is not None:
            self.server.expire()
            sent = self.server.take_released()
        with self._lock:
            arrived, self._arrived = self._arrived, []
            self._wakeup.clear()
        pulled: dict[str, bool] = {}
        for a in arrived:
            self._pending.discard(a.req_id)
            if a.req_id in self._cancelled:
                self._cancelled.discard(a.req_id)
                continue  # its blocks belong to someone else by now
            if a.ok and a.local_block_ids:
                self._apply(a)
            pulled[a.req_id] = a.ok
        return sent, pulled

    def wait(self, timeout_s: float) -> None:
        """Sleep until a pull arrives or timeout_s passes (an engine with nothing else to do)."""
        self._wakeup.wait(timeout_s)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()

    # ---- transports --------------------------------------------------------------------------
    @abstractmethod
    def _start_pull(self, pull: KVPull) -> None:
        """Fetch the pull's blocks off the engine thread, then call self._deliver(...)."""

    def _deliver(self, arrived: ArrivedPull) -> None:
        with self._lock:
            self._arrived.append(arrived)
        self._wakeup.set()

    def _apply(self, a: ArrivedPull) -> None:
        """Copy arrived blocks into the KV cache, queued on the engine thread's (compute) stream.
        On a GPU nothing here waits for the device (a step may be in flight): the ids and any
        host-staged blocks come from pinned memory, copied without blocking."""
        on_cuda = self.device.type == "cuda"
        ids = torch.tensor(a.local_block_ids, dtype=torch.int64, pin_memory=on_cuda)
        ids = ids.to(self.device, non_blocking=True)
        stream = torch.cuda.current_stream(self.device) if on_cuda else None
        for dst, src in zip(self.pool, a.blocks):
            if on_cuda and src.device.type == "cuda":
                src.record_stream(stream)  # staged on the transport's stream: keep it until this copy ran
            dst.index_copy_(0, ids, src.to(self.device, non_blocking=src.is_pinned()))


def check_layout(remote: dict, pool: list[torch.Tensor]) -> str | None:
    """Why a producer's pool cannot fill ours (None: same layout)."""
    from minivllm.kv_transfer.block_server import pool_layout
    mine = pool_layout(pool)
    if remote.get("tensors") != mine["tensors"] or remote.get("dtype") != mine["dtype"]:
        return (f"the producer's KV layout {remote.get('dtype')} {remote.get('tensors', [])[:2]}... differs from "
                f"this engine's {mine['dtype']} {mine['tensors'][:2]}...")
    return None


def make_kv_connector(config: KVTransferConfig, pool: list[torch.Tensor]) -> KVConnector:
    name = config.kv_connector or ("CudaIpcConnector" if pool[0].device.type == "cuda" else "HostConnector")
    if name == "CudaIpcConnector":
        from minivllm.kv_transfer.cuda_ipc_connector import CudaIpcConnector
        return CudaIpcConnector(config, pool)
    if name == "HostConnector":
        from minivllm.kv_transfer.host_connector import HostConnector
        return HostConnector(config, pool)
    raise ValueError(f"kv_transfer_config.kv_connector: unknown connector {name!r}")
