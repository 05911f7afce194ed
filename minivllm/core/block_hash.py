"""Block hashes for prefix caching, fit for a shared server.

A full block's hash is a cryptographic-style digest of its parent block's hash, its token ids and
the request's extra keys (the tenant's `cache_salt`, in the first block only: the chain carries it
to every later block). Two requests share a cached block only if their whole prefixes, salts
included, are equal; a tenant that does not know another's salt can neither hit nor time its
blocks. Never Python's `hash`: it is 64 bits, and its values for ints are predictable.

    sha256  hashlib.sha256, 32-byte digests (the default, as in vLLM)
    xxhash  xxhash.xxh3_128, 16-byte digests: faster, not cryptographic (one server, one tenant)
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

HASH_ALGOS = ("sha256", "xxhash")
_ROOT = b"minivllm-prefix-root"  # the parent of a first block

BlockHash = bytes
HashFn = Callable[[BlockHash | None, Sequence[int], bytes], BlockHash]


def _payload(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes) -> bytes:
    # the length prefixes keep (parent, tokens, extra) unambiguous as one byte string
    tokens = array("q", token_ids).tobytes()
    parent = _ROOT if parent is None else parent
    return b"".join((len(parent).to_bytes(2, "little"), parent, len(tokens).to_bytes(4, "little"), tokens,
                     len(extra).to_bytes(4, "little"), extra))


def sha256_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    return hashlib.sha256(_payload(parent, token_ids, extra)).digest()


def xxhash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    import xxhash
    return xxhash.xxh3_128_digest(_payload(parent, token_ids, extra))


def block_hash_fn(algo: str) -> HashFn:
    if algo not in HASH_ALGOS:
        raise ValueError(f"prefix_caching_hash_algo must be one of {list(HASH_ALGOS)}, got {algo!r}")
    if algo == "xxhash":
        try:
            import xxhash  # noqa: F401
        except ImportError:
            raise ValueError("prefix_caching_hash_algo 'xxhash' needs the xxhash package (pip install xxhash)") from None
        return xxhash_block
    return sha256_block


def extra_key(cache_salt: str | None, lora_int_id: int | None = None) -> bytes:
    """The first block's extra key of a request: its cache salt and its LoRA adapter's id (empty:
    no salt, the base model). K/V computed under one adapter never serve another."""
    key = b"" if not cache_salt else b"salt:" + cache_salt.encode("utf-8")
    if lora_int_id is not None:
        key += b"|lora:" + str(lora_int_id).encode("ascii")
    return key
