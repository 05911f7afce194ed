"""HostConnector: KV blocks over a TCP socket (one host or several; CPU or GPU KV caches).

The consumer connects to the producer's block server (block_server.py), checks once per producer
that both KV pools have the same layout, and reads a request's blocks; the bytes land in a host
staging buffer (kv_buffer_device "cpu"), or are uploaded to the GPU on the connector's own stream
(kv_buffer_device "cuda"), and poll() copies them into the KV cache. Any failure (the producer
gone, the request unknown there, a layout mismatch, a timeout) makes the pull fail: the consumer
recomputes the prompt.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from minivllm.config import KVTransferConfig
from minivllm.core.interfaces import KVPull
from minivllm.kv_transfer.connector import ArrivedPull, KVConnector, check_layout
from minivllm.kv_transfer.wire import connect, recv_exact, recv_header, send_message

logger = logging.getLogger(__name__)

PULL_THREADS = 4


class HostConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, pool: list[torch.Tensor]) -> None:
        super().__init__(config, pool)
        self._threads = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="kv-pull") if config.is_consumer else None
        self._checked: dict[tuple[str, int, str], str | None] = {}  # producer -> layout mismatch (None: same)
        self._upload_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.block_bytes = [t[0].numel() * t.element_size() for t in pool]

    def _start_pull(self, pull: KVPull) -> None:
        self._threads.submit(self._run_pull, pull)

    def _run_pull(self, pull: KVPull) -> None:
        try:
            blocks = self.fetch(pull)
            self._deliver(ArrivedPull(pull.req_id, True, pull.local_block_ids, blocks))
        except Exception as e:  # noqa: BLE001 - any failure: the consumer recomputes
            logger.warning("KV pull for request %s from %s:%d failed (%s: %s); its prompt is recomputed",
                           pull.req_id, pull.remote.host, pull.remote.port, type(e).__name__, e)
            self._deliver(ArrivedPull(pull.req_id, False, pull.local_block_ids, error=str(e)))

    def fetch(self, pull: KVPull) -> list[torch.Tensor]:
        """The pull's blocks read over the socket (the producer releases them once sent)."""
        remote = pull.remote
        with connect(remote.host, remote.port, self.config.pull_timeout_s) as sock:
            self._check_producer(sock, remote)
            if not pull.remote_block_ids:
                send_message(sock, {"op": "release", "req_id": remote.request_id})
                recv_header(sock)
                return []
            send_message(sock, {"op": "read", "req_id": remote.request_id, "block_ids": pull.remote_block_ids})
            header = recv_header(sock)
            if not header.get("ok"):
                raise RuntimeError(header.get("error", "the producer refused the read"))
            return self._receive_blocks(sock, header, pull.remote_block_ids)

    def _check_producer(self, sock, remote) -> None:
        key = (remote.host, remote.port, remote.engine_id)
        if key not in self._checked:
            send_message(sock, {"op": "info"})
            info = recv_header(sock)
            why = check_layout(info, self.pool)
            if why is None and info.get("engine_id") != remote.engine_id:
                why = f"{remote.host}:{remote.port} is engine {info.get('engine_id')}, not {remote.engine_id}"
            self._checked[key] = why
        if self._checked[key] is not None:
            raise RuntimeError(self._checked[key])

    def _receive_blocks(self, sock, header: dict, remote_ids: list[int]) -> list[torch.Tensor]:
        """The rows of every pool tensor, received into one host buffer, split into views."""
        n = len(remote_ids)
        if header.get("num_blocks") != n or header.get("payload_bytes") != n * sum(self.block_bytes):
            raise RuntimeError(f"the producer sent {header.get('num_blocks')} blocks / {header.get('payload_bytes')} "
                               f"bytes, expected {n} / {n * sum(self.block_bytes)}")
        pin = self.device.type == "cuda"
        buf = torch.empty(n * sum(self.block_bytes), dtype=torch.uint8, pin_memory=pin)
        recv_exact(sock, buf.numel(), memoryview(buf.numpy()).cast("B"))
        blocks, off = [], 0
        for t, bb in zip(self.pool, self.block_bytes):
            blocks.append(buf[off:off + n * bb].view(t.dtype).view(n, *t.shape[1:]))
            off += n * bb
        if self._upload_stream is not None and self.config.kv_buffer_device == "cuda":
            with torch.cuda.stream(self._upload_stream):
                blocks = [b.to(self.device, non_blocking=True) for b in blocks]
            self._upload_stream.synchronize()
        return blocks

    def shutdown(self) -> None:
        super().shutdown()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
