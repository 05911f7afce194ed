"""The custom (symmetric-memory) all-reduce's switches and its routing, on the CPU: when it is
built, which messages it takes, and the config names that turn it off. Its kernels run on
several GPUs only: tests/gpu/test_custom_all_reduce.py checks them against NCCL there."""

from __future__ import annotations

import pytest
import torch

from minivllm.distributed import symm_all_reduce
from minivllm.distributed.communication import TensorParallelGroup
from minivllm.distributed.symm_all_reduce import SymmetricAllReduce
from minivllm.engine.config_builder import build_engine_config


class _Group:
    group_name = "0"


@pytest.mark.parametrize("kw", [
    dict(device=torch.device("cpu")),                       # gloo ranks: NCCL's place taken by gloo
    dict(disabled=True),                                     # disable_custom_all_reduce=True
    dict(world_size=3),                                      # torch's kernels fix the order for 2, 4, 8
    dict(group=None),                                        # a single rank has no group
])
def test_not_built_where_it_cannot_or_must_not_run(kw):
    args = dict(group=_Group(), world_size=2, device=torch.device("cuda", 0), disabled=False) | kw
    assert symm_all_reduce.build(args["group"], args["world_size"], args["device"], args["disabled"]) is None


def test_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CUSTOM_ALL_REDUCE", "0")
    assert not symm_all_reduce.enabled_by_env()
    assert symm_all_reduce.build(_Group(), 2, torch.device("cuda", 0), False) is None


def _fake_comm(max_bytes=1 << 20):
    comm = object.__new__(SymmetricAllReduce)  # no GPU: only the routing rule is exercised
    comm.max_bytes = max_bytes
    return comm


@pytest.mark.parametrize("shape, dtype, takes", [
    ((1, 4096), torch.bfloat16, True),          # batch-1 decode
    ((128, 4096), torch.bfloat16, True),        # 1 MiB: the limit itself
    ((129, 4096), torch.bfloat16, False),       # over the buffer: NCCL
    ((64, 4096), torch.float32, True),
    ((64, 4096), torch.float16, False),         # torch's kernels: bf16 and fp32 only
    ((3,), torch.bfloat16, False),              # 6 bytes: not a multiple of the 16-byte vectors
    ((0, 4096), torch.bfloat16, False),         # nothing to reduce
])
def test_routing_by_dtype_and_size(shape, dtype, takes):
    assert _fake_comm().can_reduce(torch.zeros(shape, dtype=dtype)) is takes


def test_non_contiguous_and_misaligned_go_to_nccl():
    comm = _fake_comm()
    x = torch.zeros(64, 4096, dtype=torch.bfloat16)
    assert not comm.can_reduce(x.t())
    assert not comm.can_reduce(x.view(-1)[1:4097])  # 2 bytes off the allocation's alignment


class _Recorder:
    def __init__(self):
        self.calls = []

    def can_reduce(self, x):
        return x.numel() <= 8

    def all_reduce(self, x):
        self.calls.append(x.numel())
        return x.mul_(2)


def test_group_sends_what_the_kernels_take_to_them(monkeypatch):
    tp = TensorParallelGroup(None, 0, 2, torch.device("cpu"))
    tp.custom = _Recorder()
    sent_to_dist = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda x, group=None: sent_to_dist.append(x.numel()))
    small, big = torch.ones(8), torch.ones(9)
    assert torch.equal(tp.all_reduce(small), torch.full((8,), 2.0))
    tp.all_reduce(big)
    assert tp.custom.calls == [8] and sent_to_dist == [9]


def test_config_names():
    assert not build_engine_config(dtype="float32", device="cpu").parallel.disable_custom_all_reduce
    cfg = build_engine_config(dtype="float32", device="cpu", disable_custom_all_reduce=True)
    assert cfg.parallel.disable_custom_all_reduce
    # batch-invariant mode: the kernel choice by message size would make bits depend on the batch
    cfg = build_engine_config(dtype="float32", device="cpu", batch_invariant=True)
    assert cfg.parallel.disable_custom_all_reduce


def test_cli_flag_reaches_the_engine_kwargs():
    import argparse
    from minivllm.engine.args import add_engine_args, engine_kwargs
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--disable-custom-all-reduce"]))["disable_custom_all_reduce"] is True
    assert engine_kwargs(p.parse_args([]))["disable_custom_all_reduce"] is False
