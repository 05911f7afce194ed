"""The KV connectors on the CPU: a producer's block server and a consumer's HostConnector over a
real socket, in one process. Pulled blocks equal the producer's; only arrived pulls are applied,
and only in poll(); a cancelled pull is never applied; unknown requests, a dead producer and a
different layout fail the pull (the consumer recomputes); unpulled blocks are released after
send_timeout_s; config errors name the field."""

from __future__ import annotations

import time

import pytest
import torch

from minivllm.config import parse_kv_transfer_config
from minivllm.core.interfaces import KVPull, KVSend
from minivllm.kv_transfer.connector import make_kv_connector
from minivllm.kv_transfer.params import RemotePrefill
from minivllm.server.testing import free_port

NUM_BLOCKS, BS, HKV, D, LAYERS = 12, 4, 2, 8, 3


def _pool(seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g).to(dtype) for _ in range(2 * LAYERS)]


def _config(role: str, **extra):
    return parse_kv_transfer_config({"kv_role": role, "engine_id": f"{role}-e", **extra})


@pytest.fixture
def pair():
    producer = make_kv_connector(_config("kv_producer", kv_connector_extra_config={"send_timeout_s": 60}), _pool(0))
    consumer = make_kv_connector(_config("kv_consumer", kv_connector_extra_config={"pull_timeout_s": 5}), _pool(1))
    yield producer, consumer
    producer.shutdown()
    consumer.shutdown()


def _remote(producer, req_id: str, block_ids) -> RemotePrefill:
    engine_id, host, port = producer.address
    return RemotePrefill(engine_id, req_id, tuple(block_ids), host, port, len(block_ids) * BS, BS, "h")


def _poll_until(conn, req_id: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sent, pulled = conn.poll()
        if req_id in pulled:
            return pulled[req_id]
        conn.wait(0.05)
    raise AssertionError(f"pull {req_id} never arrived")


def test_pulled_blocks_equal_the_producers_and_release_them(pair):
    producer, consumer = pair
    producer.register_sends([KVSend("r1", [3, 5, 6])])
    before = [t.clone() for t in consumer.pool]
    consumer.start_pulls([KVPull("c1", _remote(producer, "r1", [3, 5, 6]), [9, 10], [5, 6])])
    assert _poll_until(consumer, "c1") is True
    for mine, old, theirs in zip(consumer.pool, before, producer.pool):
        assert torch.equal(mine[[9, 10]], theirs[[5, 6]])  # the blocks asked for ...
        assert torch.equal(mine[0], old[0]) and torch.equal(mine[1:9], old[1:9])  # ... and nothing else
    deadline = time.monotonic() + 5
    while "r1" not in producer.poll()[0]:
        assert time.monotonic() < deadline, "the producer never released its blocks"
        time.sleep(0.02)


def test_a_pull_of_no_blocks_only_releases_them(pair):
    producer, consumer = pair
    producer.register_sends([KVSend("r1", [2])])
    before = [t.clone() for t in consumer.pool]
    consumer.start_pulls([KVPull("c1", _remote(producer, "r1", [2]), [], [])])
    assert _poll_until(consumer, "c1") is True
    assert all(torch.equal(a, b) for a, b in zip(consumer.pool, before))
    deadline = time.monotonic() + 5
    while "r1" not in producer.poll()[0]:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_cancelled_pull_is_never_applied(pair):
    producer, consumer = pair
    producer.register_sends([KVSend("r1", [1])])
    before = [t.clone() for t in consumer.pool]
    consumer.start_pulls([KVPull("c1", _remote(producer, "r1", [1]), [4], [1])])
    consumer.cancel_pulls(["c1"])
    deadline = time.monotonic() + 10
    while consumer._pending:  # the transport finishes; poll drops it
        sent, pulled = consumer.poll()
        assert "c1" not in pulled
        assert time.monotonic() < deadline
        consumer.wait(0.05)
    assert all(torch.equal(a, b) for a, b in zip(consumer.pool, before))


def test_failures_make_the_pull_fail(pair):
    producer, consumer = pair
    # a request the producer does not hold (after a short wait for its registration)
    import minivllm.kv_transfer.block_server as bs
    old, bs.REGISTER_WAIT_S = bs.REGISTER_WAIT_S, 0.1
    try:
        consumer.start_pulls([KVPull("c1", _remote(producer, "nope", [1]), [4], [1])])
        assert _poll_until(consumer, "c1") is False
    finally:
        bs.REGISTER_WAIT_S = old
    # blocks the request does not hold
    producer.register_sends([KVSend("r2", [1])])
    consumer.start_pulls([KVPull("c2", _remote(producer, "r2", [1]), [4], [2])])
    assert _poll_until(consumer, "c2") is False
    # nobody listening
    dead = RemotePrefill("x", "r", (1,), "127.0.0.1", free_port(), 4, BS, "h")
    consumer.start_pulls([KVPull("c3", dead, [4], [1])])
    assert _poll_until(consumer, "c3") is False


def test_a_different_kv_layout_fails_the_pull():
    producer = make_kv_connector(_config("kv_producer"), _pool(0, torch.bfloat16))
    consumer = make_kv_connector(_config("kv_consumer"), _pool(1))
    try:
        producer.register_sends([KVSend("r1", [1])])
        consumer.start_pulls([KVPull("c1", _remote(producer, "r1", [1]), [4], [1])])
        assert _poll_until(consumer, "c1") is False
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_unpulled_blocks_are_released_after_the_send_timeout():
    producer = make_kv_connector(_config("kv_producer", kv_connector_extra_config={"send_timeout_s": 0.2}), _pool(0))
    try:
        producer.register_sends([KVSend("r1", [1, 2])])
        assert producer.poll() == ([], {})
        time.sleep(0.3)
        assert producer.poll() == (["r1"], {})
    finally:
        producer.shutdown()


@pytest.mark.parametrize("value, message", [
    ({}, "kv_transfer_config.kv_role is required"),
    ({"kv_role": "prefill"}, "kv_transfer_config.kv_role must be one of"),
    ({"kv_role": "kv_producer", "kv_connector": "Nixl"}, "kv_transfer_config.kv_connector must be one of"),
    ({"kv_role": "kv_producer", "kv_port": 70000}, "kv_transfer_config.kv_port"),
    ({"kv_role": "kv_producer", "colour": 1}, "kv_transfer_config.colour is not a kv_transfer_config field"),
    ({"kv_role": "kv_producer", "kv_connector_extra_config": {"send_timeout_s": -1}},
     "kv_transfer_config.kv_connector_extra_config.send_timeout_s must be a number > 0"),
    ("{not json", "kv_transfer_config is not valid JSON"),
])
def test_config_errors_name_the_field(value, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        parse_kv_transfer_config(value)


def test_engine_options_disaggregation_cannot_run_with_are_refused():
    from minivllm.engine.config_builder import build_engine_config
    with pytest.raises(ValueError, match="kv_transfer_config needs data_parallel_size 1"):
        build_engine_config(device="cpu", data_parallel_size=2, kv_transfer_config={"kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match="'CudaIpcConnector' needs a CUDA device"):
        build_engine_config(device="cpu", kv_transfer_config={"kv_role": "kv_consumer",
                                                              "kv_connector": "CudaIpcConnector"})
    with pytest.raises(ValueError, match="speculative decoding"):
        build_engine_config(device="cpu", kv_transfer_config='{"kv_role": "kv_both"}',
                            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    cfg = build_engine_config(device="cpu", kv_transfer_config='{"kv_role": "kv_both"}')
    assert cfg.kv_transfer.is_producer and cfg.kv_transfer.is_consumer and cfg.kv_transfer.engine_id


def test_release_all_releases_what_is_not_being_read():
    """Shutting down: held blocks go back at once (a later pull fails: the consumer recomputes)."""
    producer = make_kv_connector(_config("kv_producer"), _pool(0))
    try:
        producer.register_sends([KVSend("r1", [1]), KVSend("r2", [2])])
        producer.server.release_all()
        sent, _ = producer.poll()
        assert sorted(sent) == ["r1", "r2"] and producer.server.num_held == 0
    finally:
        producer.shutdown()
