"""CudaIpcConnector: a producer and a consumer on GPUs of one host copy blocks device to device.

The producer's block server exports its KV pool tensors once (torch's reduce_tensor: CUDA IPC
memory handles); the consumer maps them on the device whose UUID the producer reports (the two
processes may see the GPUs under different CUDA_VISIBLE_DEVICES numbering) and, per pull:

    acquire (the producer keeps the blocks) -> gather the blocks on the connector's stream into a
    staging tensor on this engine's device -> synchronize -> release -> poll() copies the staging
    tensor into the KV cache on the compute stream

If the producer's GPU is not visible here (or mapping fails), the host transport is used
(HostConnector's socket read).
"""

from __future__ import annotations

import logging

import torch

from minivllm.config import KVTransferConfig
from minivllm.core.interfaces import KVPull
from minivllm.kv_transfer.host_connector import HostConnector
from minivllm.kv_transfer.wire import connect, loads_torch_only, recv_header, recv_message, send_message

logger = logging.getLogger(__name__)


def local_device_of(uuid: str | None) -> int | None:
    """The index, in this process's numbering, of the GPU with this UUID (None: not visible)."""
    if uuid is None or not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None


def map_ipc_tensors(handles: list, device_index: int) -> list[torch.Tensor]:
    """Rebuild the producer's tensors from (rebuild function, args) pairs, on our device index.
    Argument 6 of torch's rebuild_cuda_tensor is the storage's device index."""
    out = []
    for fn, args in handles:
        args = list(args)
        args[6] = device_index
        out.append(fn(*args))
    return out


class CudaIpcConnector(HostConnector):
    def __init__(self, config: KVTransferConfig, pool: list[torch.Tensor]) -> None:
        assert pool[0].device.type == "cuda", "CudaIpcConnector needs a KV cache on a GPU"
        super().__init__(config, pool)
        self._mapped: dict[str, list[torch.Tensor] | None] = {}  # producer engine id -> its pool (None: host path)
        self._copy_stream = torch.cuda.Stream(self.device)

    def fetch(self, pull: KVPull) -> list[torch.Tensor]:
        remote = self._remote_pool(pull)
        if remote is None:
            return super().fetch(pull)
        with connect(pull.remote.host, pull.remote.port, self.config.pull_timeout_s) as sock:
            send_message(sock, {"op": "acquire", "req_id": pull.remote.request_id, "block_ids": pull.remote_block_ids})
            answer = recv_header(sock)
            try:
                if not answer.get("ok"):
                    raise RuntimeError(answer.get("error") or "the producer refused the pull")
                return self._gather(remote, pull.remote_block_ids)
            finally:
                send_message(sock, {"op": "release", "req_id": pull.remote.request_id})
                recv_header(sock)

    def _gather(self, remote: list[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
        """The blocks copied out of the producer's pool into new tensors on our device (batched:
        one index_select per tensor), complete when this returns."""
        if not block_ids:
            return []
        src_device = remote[0].device
        with torch.cuda.stream(self._copy_stream):
            ids = torch.tensor(block_ids, dtype=torch.int64, device=src_device)
            blocks = [t.index_select(0, ids).to(self.device, non_blocking=True) for t in remote]
        if src_device != self.device:
            torch.cuda.synchronize(src_device)  # (work on another device runs on its own current stream)
        self._copy_stream.synchronize()
        return blocks

    def _remote_pool(self, pull: KVPull) -> list[torch.Tensor] | None:
        """The producer's KV tensors mapped here, or None when its GPU is not visible (host path)."""
        engine_id = pull.remote.engine_id
        if engine_id in self._mapped:
            return self._mapped[engine_id]
        mapped = None
        try:
            mapped = self._map(pull)
        except Exception as e:  # noqa: BLE001 - the host path still works
            logger.warning("CUDA IPC to producer %s failed (%s: %s); using the host transport", engine_id,
                           type(e).__name__, e)
        self._mapped[engine_id] = mapped
        return mapped

    def _map(self, pull: KVPull) -> list[torch.Tensor] | None:
        from minivllm.kv_transfer.connector import check_layout
        with connect(pull.remote.host, pull.remote.port, self.config.pull_timeout_s) as sock:
            send_message(sock, {"op": "info"})
            info = recv_header(sock)
            why = check_layout(info, self.pool)
            if why is not None:
                raise RuntimeError(why)
            index = local_device_of(info.get("device_uuid"))
            if index is None:
                logger.info("producer %s's GPU %s is not visible here: KV blocks come over the host transport",
                            pull.remote.engine_id, info.get("device_uuid"))
                return None
            send_message(sock, {"op": "ipc_handles"})
            header, payload = recv_message(sock)
            if not header.get("ok"):
                raise RuntimeError(header.get("error", "the producer sent no IPC handles"))
            tensors = map_ipc_tensors(loads_torch_only(payload), index)
        logger.info("mapped producer %s's KV pool (%d tensors) through CUDA IPC on cuda:%d", pull.remote.engine_id,
                    len(tensors), index)
        return tensors
