"""A producer's block server: finished prompts' KV blocks, held until a consumer takes them.

The engine registers each held request (`register`); consumers connect over TCP (wire.py) and ask:

    info                    -> the pool's layout (tensors, per-block shapes, dtype) and GPU UUID
    read {req_id, block_ids} -> those of the request's blocks (the consumer's own prefix cache may
                               hold the others), every tensor's rows in pool order; all released
    acquire {req_id}        -> (CUDA IPC) the blocks stay held while the consumer copies them ...
    release {req_id}        -> ... and are released
    ipc_handles             -> (CUDA) the pool's tensors as torch IPC handles, once per consumer

A request not pulled within send_timeout_s is released all the same (`expire`, from the engine's
poll), so blocks are never held forever. Released ids are what `take_released` returns; the
scheduler frees those blocks. A request is popped from the registry before its blocks are read,
so an expiry can never free blocks that a read is still copying.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time

import torch

from minivllm.kv_transfer.wire import WireError, recv_header, send_message

logger = logging.getLogger(__name__)

REGISTER_WAIT_S = 5.0  # a read may arrive before the engine registered the request: wait this long


def device_uuid(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def pool_layout(pool: list[torch.Tensor]) -> dict:
    """What both ends must agree on for block copies to mean anything."""
    return {"tensors": [list(t.shape[1:]) for t in pool], "dtype": str(pool[0].dtype)}


class BlockServer:
    def __init__(self, pool: list[torch.Tensor], engine_id: str, host: str, port: int, send_timeout_s: float) -> None:
        self.pool = pool
        self.engine_id = engine_id
        self.send_timeout_s = send_timeout_s
        self.device = pool[0].device
        self._cond = threading.Condition()
        self._exports: dict[str, tuple[list[int], float]] = {}  # req id -> (block ids, deadline)
        self._in_use: dict[str, tuple[list[int], float]] = {}  # acquired (CUDA IPC copies running)
        self._released: list[str] = []
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._sock = socket.create_server((host, port), reuse_port=False)
        # the address consumers are told (a wildcard bind is reached through this host's address)
        self.host = socket.gethostbyname(socket.gethostname()) if host in ("0.0.0.0", "::", "") else host
        self.port = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept_loop, name="kv-block-server", daemon=True).start()
        logger.info("KV block server of engine %s listening on %s:%d", engine_id, self.host, self.port)

    # ---- engine side -----------------------------------------------------------------------
    def register(self, req_id: str, block_ids: list[int]) -> None:
        with self._cond:
            self._exports[req_id] = (list(block_ids), time.monotonic() + self.send_timeout_s)
            self._cond.notify_all()

    def expire(self) -> None:
        """Releases requests nobody pulled (or finished copying) within send_timeout_s."""
        now = time.monotonic()
        with self._cond:
            for table in (self._exports, self._in_use):
                for req_id in [r for r, (_, deadline) in table.items() if deadline < now]:
                    del table[req_id]
                    self._released.append(req_id)
                    logger.warning("KV blocks of request %s were not pulled within %.0f s: released", req_id,
                                   self.send_timeout_s)

    def release_all(self) -> None:
        """Every held request not being read now is released (reads in progress release theirs)."""
        with self._cond:
            self._released += list(self._exports)
            self._exports.clear()

    def take_released(self) -> list[str]:
        with self._cond:
            out, self._released = self._released, []
        return out

    @property
    def num_held(self) -> int:
        with self._cond:
            return len(self._exports) + len(self._in_use)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    # ---- consumer side ---------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="kv-block-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    header = recv_header(conn)
                    self._answer(conn, header)
            except (WireError, OSError):
                return  # the consumer went away
            except Exception:  # noqa: BLE001 - one bad connection never takes the server down
                logger.exception("KV block server: a request failed")

    def _answer(self, conn: socket.socket, header: dict) -> None:
        op, req_id = header.get("op"), header.get("req_id")
        if op == "info":
            send_message(conn, {"ok": True, "engine_id": self.engine_id, "device_uuid": device_uuid(self.device),
                                "pid": os.getpid(), **pool_layout(self.pool)})
        elif op == "read":
            block_ids = self._take(req_id, self._exports)
            if block_ids is None:
                send_message(conn, {"ok": False, "error": f"no KV blocks held for request {req_id!r}"})
                return
            try:
                wanted = header.get("block_ids", block_ids)
                if not isinstance(wanted, list) or not set(wanted) <= set(block_ids):
                    send_message(conn, {"ok": False, "error": f"block_ids must be some of the request's {block_ids}"})
                    return
                parts = self._read_blocks(wanted)
                send_message(conn, {"ok": True, "num_blocks": len(wanted)}, parts)
            finally:
                self._release(req_id)
        elif op == "acquire":
            block_ids = self._take(req_id, self._exports)
            if block_ids is None:
                send_message(conn, {"ok": False, "error": f"no KV blocks held for request {req_id!r}"})
                return
            with self._cond:
                self._in_use[req_id] = (block_ids, time.monotonic() + self.send_timeout_s)
            wanted = header.get("block_ids", block_ids)
            ok = isinstance(wanted, list) and set(wanted) <= set(block_ids)
            send_message(conn, {"ok": ok, "error": None if ok else f"block_ids must be some of the request's {block_ids}"})
        elif op == "release":
            with self._cond:
                known = self._in_use.pop(req_id, None) or self._exports.pop(req_id, None)
            if known is not None:
                self._release(req_id)
            send_message(conn, {"ok": True})
        elif op == "ipc_handles":
            self._send_ipc_handles(conn)
        else:
            send_message(conn, {"ok": False, "error": f"unknown op {op!r}"})

    def _take(self, req_id, table: dict) -> list[int] | None:
        """The request's block ids, taken out of `table` (waiting briefly for its registration)."""
        with self._cond:
            self._cond.wait_for(lambda: req_id in table, timeout=REGISTER_WAIT_S)
            entry = table.pop(req_id, None)
        return None if entry is None else entry[0]

    def _release(self, req_id: str) -> None:
        with self._cond:
            self._released.append(req_id)

    def _read_blocks(self, block_ids: list[int]) -> list[memoryview]:
        """The blocks' bytes, tensor after tensor. Their K/V was written by steps the engine has
        already waited for (the request finished), so no ordering with the compute stream is needed."""
        if not block_ids:
            return []
        if self._stream is None:
            ids = torch.tensor(block_ids, dtype=torch.int64)
            rows = [t.index_select(0, ids) for t in self.pool]
        else:
            with torch.cuda.stream(self._stream):
                ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
                rows = [t.index_select(0, ids).to("cpu") for t in self.pool]
        return [memoryview(r.contiguous().view(torch.uint8).numpy()).cast("B") for r in rows]

    def _send_ipc_handles(self, conn: socket.socket) -> None:
        if self.device.type != "cuda":
            send_message(conn, {"ok": False, "error": "this producer's KV cache is not on a GPU"})
            return
        from torch.multiprocessing.reductions import reduce_tensor
        handles = pickle.dumps([reduce_tensor(t) for t in self.pool])
        send_message(conn, {"ok": True}, handles)
