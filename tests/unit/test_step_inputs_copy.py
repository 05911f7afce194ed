"""runner/input_batch.py's to_device_packed: a step's int arrays reach the device through one
copy as views of one buffer, each with its dtype, shape and values, at 16-byte-aligned offsets;
build_step_inputs gives the same tensors with the one copy on and off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.core.interfaces import ScheduledRequest
from minivllm.runner import input_batch as ib


def _arrays():
    return [np.arange(5, dtype=np.int64) * 3, np.array([0, 1, 7], dtype=np.int32),
            np.zeros(0, dtype=np.int64), np.arange(12, dtype=np.int32).reshape(3, 4) - 6,
            np.array([2**40, -1], dtype=np.int64)]


def test_packed_views_keep_dtype_shape_values_and_alignment():
    arrays = _arrays()
    got = ib.to_device_packed(arrays, torch.device("cpu"), pin=False)
    base = got[0].untyped_storage().data_ptr()
    for a, t in zip(arrays, got):
        assert t.dtype == ib._TORCH_DTYPES[a.dtype] and tuple(t.shape) == a.shape
        assert np.array_equal(t.numpy(), a)
        assert t.untyped_storage().data_ptr() == base  # one buffer
        assert (t.data_ptr() - base) % ib.ALIGN == 0
    got[1][0] = 99  # views do not overlap: writing one leaves the others
    assert np.array_equal(got[0].numpy(), arrays[0]) and np.array_equal(got[3].numpy(), arrays[3])


def test_switch_off_copies_each_array(monkeypatch):
    monkeypatch.setenv("MINIVLLM_STEP_INPUTS_ONE_COPY", "0")
    arrays = _arrays()
    got = ib.to_device_packed(arrays, torch.device("cpu"), pin=False)
    assert len({t.untyped_storage().data_ptr() for t in got if t.numel()}) == 4
    assert all(np.array_equal(t.numpy(), a) for a, t in zip(arrays, got))


@pytest.mark.parametrize("one_copy", ["1", "0"])
def test_build_step_inputs_same_with_and_without_one_copy(monkeypatch, one_copy):
    monkeypatch.setenv("MINIVLLM_STEP_INPUTS_ONE_COPY", one_copy)
    sched = [ScheduledRequest("a", [5, 6, 7], 0, [], True),
             ScheduledRequest("b", [9], 20, [], True)]
    inputs = ib.build_step_inputs(sched, {"a": [3], "b": [1, 4]}, 16, torch.device("cpu"), pin=False)
    assert inputs.input_ids.tolist() == [5, 6, 7, 9] and inputs.positions.tolist() == [0, 1, 2, 20]
    assert inputs.meta.slot_mapping.tolist() == [48, 49, 50, 4 * 16 + 4]
    assert inputs.meta.query_start_loc.tolist() == [0, 3, 4] and inputs.meta.seq_lens.tolist() == [3, 21]
    assert inputs.meta.block_tables.tolist() == [[3, 0], [1, 4]] and inputs.meta.block_tables.dtype == torch.int32
    assert inputs.logits_indices.tolist() == [2, 3]
