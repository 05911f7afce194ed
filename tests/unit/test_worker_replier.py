"""The mp driver's reply thread (executor/worker.py: serve, Replier), against a fake runner over a
real pipe: with async scheduling the driver answers each step once the step itself is done, not
when the next step arrives; the request state still takes a step in only after the next launch;
answers keep their order; MoE counts ride on the next output; an error in the thread is reported."""

from __future__ import annotations

import os
import pickle
import threading
from multiprocessing import Pipe

import sys

import pytest
import torch

from minivllm.core.interfaces import RunnerOutput
from minivllm.executor import worker as worker_mod

TIMEOUT_S = 10.0


@pytest.fixture(autouse=True)
def reply_thread_on(monkeypatch):
    """The thread is opt-in (MINIVLLM_DRIVER_REPLY_THREAD=1); these tests are about it."""
    monkeypatch.setenv("MINIVLLM_DRIVER_REPLY_THREAD", "1")


class FakeRunner:
    def __init__(self, fail_on: str | None = None) -> None:
        self.device = torch.device("cpu")
        self.taken_in: list[str] = []
        self.counts: list[list[int]] | None = None
        self.fail_on = fail_on
        self.released = {}  # step -> threading.Event: step_output waits for it (the "device")
        self.expert_counts = self

    def per_layer(self):
        return [[7, 8]]

    def step_output(self, step: str) -> RunnerOutput:
        self.released.setdefault(step, threading.Event()).wait(TIMEOUT_S)
        if step == self.fail_on:
            raise RuntimeError(f"device fault in {step}")
        return RunnerOutput([step], [[len(step)]])

    def take_in(self, step: str) -> None:
        self.taken_in.append(step)

    def new_expert_counts(self):
        counts, self.counts = self.counts, None
        return counts

    def finish(self, step: str) -> RunnerOutput:
        self.take_in(step)
        return self.step_output(step)


class FakeWorker:
    is_driver = True

    def __init__(self, runner: FakeRunner) -> None:
        self.runner = runner

    def launch(self, sched, grammar):
        return sched

    def finish(self, step):
        return self.runner.finish(step)


def _start(runner: FakeRunner, overlap: bool = True):
    ours, theirs = Pipe()
    thread = threading.Thread(target=worker_mod.serve, args=(theirs, FakeWorker(runner), overlap), daemon=True)
    thread.start()
    return ours, thread


def _send(conn, *msg) -> None:
    conn.send_bytes(pickle.dumps(msg))


def _recv(conn):
    assert conn.poll(TIMEOUT_S), "no answer from the worker"
    return pickle.loads(conn.recv_bytes())


def _reply_threads() -> set:
    return {t for t in threading.enumerate() if t.name == "minivllm-driver-replies"}


def _release(runner: FakeRunner, step: str) -> None:
    runner.released.setdefault(step, threading.Event()).set()


def test_the_driver_answers_a_step_when_it_is_done_not_when_the_next_arrives():
    interval = sys.getswitchinterval()
    runner = FakeRunner()
    conn, thread = _start(runner)
    _send(conn, "step", "a", None)
    assert not conn.poll(0.3)  # the device has not finished step a
    _release(runner, "a")
    msg = _recv(conn)  # with no next step sent: the old protocol answered only then
    assert msg[0] == "out" and msg[1].req_ids == ["a"] and msg[1].sampled_token_ids == [[1]]
    assert runner.taken_in == []  # the state takes a in after the next launch, as before
    _release(runner, "bb")
    _send(conn, "step", "bb", None)
    assert _recv(conn)[1].req_ids == ["bb"]
    _send(conn, "finish")
    _send(conn, "stop")
    thread.join(TIMEOUT_S)
    assert not thread.is_alive()
    assert runner.taken_in == ["a", "bb"]
    assert sys.getswitchinterval() == interval  # the reply thread's shorter interval is undone


def test_answers_keep_the_launch_order_and_counts_ride_on_the_next_output():
    runner = FakeRunner()
    runner.counts = [[1, 2]]  # published when the main thread takes a in (after b's launch)
    conn, thread = _start(runner)
    for step in ("a", "b", "c"):
        _send(conn, "step", step, None)
    _release(runner, "c")  # c is done first; a and b are still running
    assert not conn.poll(0.3)
    _release(runner, "a")
    _release(runner, "b")
    outs = [_recv(conn)[1] for _ in range(3)]
    assert [o.req_ids for o in outs] == [["a"], ["b"], ["c"]]
    assert [o.expert_token_counts for o in outs] == [[[1, 2]], None, None]  # a's output is built after
    _send(conn, "finish")
    _send(conn, "expert_counts")
    assert _recv(conn) == ("counts", [[7, 8]])
    _send(conn, "stop")
    thread.join(TIMEOUT_S)
    assert runner.taken_in == ["a", "b", "c"]


def test_without_async_scheduling_the_main_thread_answers():
    runner = FakeRunner()
    _release(runner, "a")
    repliers = _reply_threads()
    conn, thread = _start(runner, overlap=False)
    _send(conn, "step", "a", None)
    assert _recv(conn)[1].req_ids == ["a"]
    _send(conn, "stop")
    thread.join(TIMEOUT_S)
    assert runner.taken_in == ["a"]
    assert _reply_threads() == repliers  # none started


@pytest.mark.parametrize("setting", ["0", None])
def test_the_switch_turns_the_thread_off(monkeypatch, setting):
    if setting is None:  # unset: off by default
        monkeypatch.delenv("MINIVLLM_DRIVER_REPLY_THREAD")
    else:
        monkeypatch.setenv("MINIVLLM_DRIVER_REPLY_THREAD", setting)
    runner = FakeRunner()
    _release(runner, "a")
    conn, thread = _start(runner)
    _send(conn, "step", "a", None)
    assert not conn.poll(0.3)  # as before the thread: a's output waits for the next step or "finish"
    _send(conn, "finish")
    assert _recv(conn)[1].req_ids == ["a"]
    _send(conn, "stop")
    thread.join(TIMEOUT_S)
    assert runner.taken_in == ["a"]


def test_a_failure_in_the_reply_thread_is_reported(monkeypatch):
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    runner = FakeRunner(fail_on="a")
    conn, _ = _start(runner)
    _send(conn, "step", "a", None)
    _release(runner, "a")
    msg = _recv(conn)
    assert msg[0] == "error" and "device fault in a" in msg[1]
    for _ in range(100):
        if exits:
            break
        threading.Event().wait(0.05)
    assert exits == [1]
    _send(conn, "stop")  # the main thread is still in its loop: let it end
