"""Prefix-cache block hashes (core/block_hash.py): digests of (parent, token ids, cache salt), not
Python's hash; tenants with different cache salts never share a block, the same salt does."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from array import array

import pytest

from minivllm.core.block_hash import block_hash_fn, extra_key, sha256_block, xxhash_block
from minivllm.core.block_manager import BlockManager
from minivllm.core.request import Request
from minivllm.sampling_params import SamplingParams


def test_sha256_block_is_the_documented_digest():
    tokens = array("q", [5, 6, 7]).tobytes()
    root = b"minivllm-prefix-root"
    payload = (len(root).to_bytes(2, "little") + root + len(tokens).to_bytes(4, "little") + tokens
               + (0).to_bytes(4, "little"))
    assert sha256_block(None, [5, 6, 7]) == hashlib.sha256(payload).digest()
    assert len(sha256_block(None, [5, 6, 7])) == 32 and len(xxhash_block(None, [5, 6, 7])) == 16


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_hashes_separate_parents_tokens_and_salts(algo):
    h = block_hash_fn(algo)
    a = h(None, [1, 2, 3, 4])
    assert h(None, [1, 2, 3, 4]) == a
    assert len({a, h(None, [1, 2, 3, 5]), h(a, [1, 2, 3, 4]), h(None, [1, 2, 3, 4], extra_key("tenant-a")),
                h(None, [1, 2, 3, 4], extra_key("tenant-b"))}) == 5
    # no ambiguity between where the tokens end and the salt starts
    assert h(None, [1], b"\x02") != h(None, [1, 2], b"")


def test_hashes_do_not_depend_on_the_process():
    """Python's hash() of ints is predictable and of str salted per process: neither is used."""
    code = "from minivllm.core.block_hash import sha256_block; print(sha256_block(None, [1, 2], b'salt').hex())"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout for seed in (1, 2)}
    assert outs == {sha256_block(None, [1, 2], b"salt").hex() + "\n"}


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        block_hash_fn("md5")


def _req(rid, tokens, salt):
    return Request(rid, tokens, SamplingParams(max_tokens=4), frozenset(), 0.0, 4, cache_salt=salt)


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_different_salts_never_share_blocks_and_the_same_salt_does(algo):
    bm = BlockManager(num_blocks=32, block_size=4, enable_caching=True, hash_algo=algo)
    prompt = list(range(17))  # four full blocks
    first = _req("a", prompt, "tenant-a")
    assert bm.allocate(first, len(prompt)) is not None
    first.num_computed_tokens = len(prompt)
    bm.register_computed_blocks(first)
    for salt, expected in (("tenant-b", 0), (None, 0), ("tenant-a", 4)):
        other = _req(f"x-{salt}", prompt, salt)
        assert len(bm.find_cached_prefix(other)) == expected, salt
