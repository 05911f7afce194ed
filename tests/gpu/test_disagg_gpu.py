"""Disaggregated prefill/decode on a GPU: the CUDA IPC connector between two processes on one
GPU (the blocks copied equal the producer's, device to device), and prefill + decode instances
behind the router giving a single instance's greedy outputs."""

from __future__ import annotations

import json
import multiprocessing as mp
import sys

import httpx
import pytest
import torch

pytestmark = pytest.mark.gpu

NUM_BLOCKS, BS, HKV, D, LAYERS = 32, 16, 4, 64, 4
SEND = [3, 7, 8, 20]


def _producer_main(queue, done) -> None:
    from minivllm.config import parse_kv_transfer_config
    from minivllm.core.interfaces import KVSend
    from minivllm.kv_transfer.connector import make_kv_connector
    torch.manual_seed(0)
    pool = [torch.randn(NUM_BLOCKS, BS, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    conn = make_kv_connector(parse_kv_transfer_config({"kv_role": "kv_producer", "engine_id": "gpu-p",
                                                       "kv_connector": "CudaIpcConnector"}), pool)
    conn.register_sends([KVSend("r1", SEND)])
    queue.put((conn.address, [t[SEND].cpu() for t in pool]))
    done.wait(120)  # keep the pool alive while the consumer maps and copies it
    released = conn.poll()[0]
    queue.put(released)
    conn.shutdown()


def test_cuda_ipc_connector_copies_blocks_between_two_processes_on_one_gpu():
    import time

    from minivllm.config import parse_kv_transfer_config
    from minivllm.core.interfaces import KVPull
    from minivllm.kv_transfer.connector import make_kv_connector
    from minivllm.kv_transfer.params import RemotePrefill
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_producer_main, args=(queue, done))
    child.start()
    try:
        (engine_id, host, port), want = queue.get(timeout=120)
        pool = [torch.zeros(NUM_BLOCKS, BS, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
        consumer = make_kv_connector(parse_kv_transfer_config({"kv_role": "kv_consumer",
                                                               "kv_connector": "CudaIpcConnector"}), pool)
        local = [1, 2, 30, 31]
        remote = RemotePrefill(engine_id, "r1", tuple(SEND), host, port, len(SEND) * BS, BS, "h")
        consumer.start_pulls([KVPull("c1", remote, local, SEND)])
        deadline = time.monotonic() + 60
        pulled = {}
        while "c1" not in pulled:
            assert time.monotonic() < deadline, "the pull never arrived"
            pulled.update(consumer.poll()[1])
            consumer.wait(0.05)
        assert pulled["c1"] is True
        assert consumer._mapped[engine_id] is not None  # device to device, not the host path
        torch.cuda.synchronize()
        for t, w in zip(pool, want):
            assert torch.equal(t[local].cpu(), w)
            assert not t[0].any()  # nothing else written
        consumer.shutdown()
        done.set()
        assert queue.get(timeout=60) == ["r1"]  # the producer's blocks were released after the copy
    finally:
        done.set()
        child.join(60)
        if child.is_alive():
            child.kill()


def test_prefill_and_decode_instances_give_a_single_instances_greedy_outputs():
    from minivllm.server.testing import free_port, spawn_server
    common = [sys.executable, "-m", "minivllm", "serve", "--max-model-len", "2048", "--dtype", "float32",
              "--no-dashboard", "--uvicorn-log-level", "warning"]
    procs, urls = [], {}
    try:
        for name, role in (("single", None), ("prefill", "kv_producer"), ("decode", "kv_consumer")):
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            cmd = common + ["--port", str(port), "--kv-cache-memory-bytes", str(1 << 30)]  # three on one GPU
            if role:
                cmd += ["--kv-transfer-config", json.dumps({"kv_role": role})]
            procs.append(spawn_server(cmd, urls[name]))
        port = free_port()
        urls["router"] = f"http://127.0.0.1:{port}"
        procs.append(spawn_server([sys.executable, "-m", "minivllm", "router", "--port", str(port), "--prefill",
                                   urls["prefill"], "--decode", urls["decode"]], urls["router"]))
        prompts = ["The capital of France is", "def quicksort(a):",
                   " ".join(f"Item {i}: the quick brown fox." for i in range(60))]
        for p in prompts:
            body = {"prompt": p, "max_tokens": 32, "temperature": 0}
            want = httpx.post(urls["single"] + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
            got = httpx.post(urls["router"] + "/v1/completions", json=body, timeout=120)
            assert got.status_code == 200 and got.json()["choices"][0]["text"] == want, got.text
        load = httpx.get(urls["decode"] + "/load", timeout=10).json()
        assert load["kv_pulled_blocks"] > 0 and load["kv_pull_failures"] == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()
