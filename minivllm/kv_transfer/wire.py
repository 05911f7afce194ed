"""The KV connectors' socket framing: each message is a JSON header, optionally followed by a raw
payload of header["payload_bytes"] bytes (block contents, or the CUDA IPC handles).

    [4 bytes big-endian header length][header JSON][payload]

Block bytes are never pickled. The CUDA IPC handles are (torch's own reduce_tensor output), read
back with an unpickler that only accepts torch's classes and functions.
"""

from __future__ import annotations

import io
import json
import pickle
import socket
import struct

_LEN = struct.Struct(">I")
MAX_HEADER_BYTES = 16 << 20


class WireError(ConnectionError):
    """The peer closed the connection, or sent something that is not a message."""


def send_message(sock: socket.socket, header: dict, payload: list[memoryview] | bytes | None = None) -> None:
    """One message; payload: bytes, or buffers sent one after the other (their total in the header)."""
    parts = [] if payload is None else [payload] if isinstance(payload, (bytes, bytearray)) else payload
    header = dict(header, payload_bytes=sum(len(memoryview(p).cast("B")) for p in parts))
    data = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(data)) + data)
    for p in parts:
        sock.sendall(p)


def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    """n bytes from the socket, into `into` if given (it must hold n bytes)."""
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise WireError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def recv_header(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_HEADER_BYTES:
        raise WireError(f"message header of {n} bytes (at most {MAX_HEADER_BYTES})")
    try:
        header = json.loads(bytes(recv_exact(sock, n)))
    except json.JSONDecodeError as e:
        raise WireError(f"message header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise WireError("message header is not an object")
    return header


def recv_message(sock: socket.socket) -> tuple[dict, bytes]:
    header = recv_header(sock)
    payload = bytes(recv_exact(sock, int(header.get("payload_bytes", 0))))
    return header, payload


class _TorchOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" or module.startswith("torch."):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in CUDA IPC handles")


def loads_torch_only(data: bytes):
    return _TorchOnlyUnpickler(io.BytesIO(data)).load()


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
