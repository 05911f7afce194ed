"""kv_transfer_params: what a request carries between a prefill and a decode instance (pure Python).

vLLM's shape (its P/D proxy sends the same dicts):

    to the prefill instance:   {"do_remote_decode": true}
    its answer (in the response, and then sent to the decode instance with the original request):
        {"do_remote_prefill": true, "remote_engine_id": ..., "remote_request_id": ...,
         "remote_block_ids": [...], "remote_host": ..., "remote_port": ..., "num_tokens": N,
         "block_size": B, "prompt_hash": ...}

The producer's blocks hold the K/V of the prompt's N tokens; the consumer takes those of the first
N - 1 and computes the last prompt token itself, so it samples the first token as a single
instance would.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

KV_TRANSFER_PARAMS = "kv_transfer_params"  # the key in SamplingParams.extra_args


@dataclass(frozen=True)
class RemotePrefill:
    """A consumer's request: pull the prompt's K/V from the producer that computed it."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    num_tokens: int
    block_size: int
    prompt_hash: str


def prompt_hash(token_ids: list[int]) -> str:
    """Identifies a prompt across instances (the consumer checks it is the producer's)."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


def _check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"kv_transfer_params.{name} {msg}")


def _int(d: dict, name: str, low: int = 0) -> int:
    v = d.get(name)
    _check(isinstance(v, int) and not isinstance(v, bool) and v >= low, name, f"must be an integer >= {low}, got {v!r}")
    return v


def _str(d: dict, name: str) -> str:
    v = d.get(name)
    _check(isinstance(v, str) and bool(v), name, f"must be a non-empty string, got {v!r}")
    return v


def parse(params) -> tuple[bool, RemotePrefill | None]:
    """(do_remote_decode, RemotePrefill or None) of a request's kv_transfer_params (None: (False,
    None)). Raises ValueError naming the field."""
    if params is None:
        return False, None
    _check(isinstance(params, dict), "", f"must be an object, got {type(params).__name__}")
    decode, prefill = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
    _check(not (decode and prefill), "do_remote_prefill", "and do_remote_decode cannot both be true")
    if not prefill:
        return decode, None
    ids = params.get("remote_block_ids")
    _check(isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids),
           "remote_block_ids", "must be a list of block ids (integers >= 0)")
    remote = RemotePrefill(engine_id=_str(params, "remote_engine_id"), request_id=_str(params, "remote_request_id"),
                           block_ids=tuple(ids), host=_str(params, "remote_host"),
                           port=_int(params, "remote_port", 1), num_tokens=_int(params, "num_tokens", 1),
                           block_size=_int(params, "block_size", 1), prompt_hash=_str(params, "prompt_hash"))
    _check(remote.port <= 65535, "remote_port", f"must be <= 65535, got {remote.port}")
    return False, remote


def of_sampling_params(sp) -> dict | None:
    extra = getattr(sp, "extra_args", None)
    return extra.get(KV_TRANSFER_PARAMS) if extra else None


def producer_answer(engine_id: str, request_id: str, block_ids: list[int], host: str, port: int,
                    prompt_token_ids: list[int], block_size: int) -> dict:
    """What a producer's response carries for the decode instance."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_request_id": request_id, "remote_block_ids": list(block_ids), "remote_host": host,
            "remote_port": port, "num_tokens": len(prompt_token_ids), "block_size": block_size,
            "prompt_hash": prompt_hash(prompt_token_ids)}
