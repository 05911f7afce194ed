"""BlockTableRows (runner/input_batch.py) keeps the runner's block tables as numpy rows: after any
sequence of new tables, appended blocks, in-place rewrites and removals (rows reused, the array
grown in both directions), a gather equals the tables built from the lists, zeros past each end."""

from __future__ import annotations

import random

import numpy as np
import torch

from minivllm.core.interfaces import PLACEHOLDER_TOKEN, ScheduledRequest
from minivllm.runner.input_batch import BlockTableRows, build_step_inputs


def _from_lists(tables: dict[str, list[int]], ids: list[str]) -> np.ndarray:
    out = np.zeros((len(ids), max(1, max(len(tables[r]) for r in ids))), dtype=np.int32)
    for i, r in enumerate(ids):
        out[i, :len(tables[r])] = tables[r]
    return out


def test_random_operations_match_the_lists():
    rng = random.Random(0)
    rows, lists = BlockTableRows(rows=2, cols=2), {}
    for step in range(3000):
        op = rng.random()
        if op < 0.15 or not lists:
            rid = f"r{rng.randrange(60)}"
            lists[rid] = [rng.randrange(10_000) for _ in range(rng.randrange(0, 5))]
            rows.set(rid, lists[rid])
        elif op < 0.7:
            rid = rng.choice(list(lists))
            new = [rng.randrange(10_000) for _ in range(rng.randrange(0, 4))]
            lists[rid] += new
            rows.extend(rid, new)
        elif op < 0.8:  # copy-on-write: one entry replaced, the row written again
            rid = rng.choice(list(lists))
            if lists[rid]:
                lists[rid][rng.randrange(len(lists[rid]))] = rng.randrange(10_000)
                rows.set(rid, lists[rid])
        else:
            rid = rng.choice(list(lists))
            del lists[rid]
            rows.remove(rid)
        if lists and step % 7 == 0:
            ids = rng.sample(list(lists), rng.randrange(1, len(lists) + 1))
            np.testing.assert_array_equal(rows.gather(ids), _from_lists(lists, ids))
    assert rows.table.shape[0] >= 2 and rows.table.shape[1] > 2  # grew both ways


def test_step_inputs_same_from_rows_and_from_lists():
    rng = random.Random(1)
    tables = {f"r{i}": [rng.randrange(5000) for _ in range(rng.randrange(1, 30))] for i in range(40)}
    rows = BlockTableRows()
    for rid, t in tables.items():
        rows.set(rid, t)
    sched = [ScheduledRequest(rid, [PLACEHOLDER_TOKEN], len(t) * 16 - 1 - rng.randrange(16), [], True)
             for rid, t in tables.items()]
    a = build_step_inputs(sched, tables, 16, torch.device("cpu"), False)
    b = build_step_inputs(sched, rows, 16, torch.device("cpu"), False)
    assert torch.equal(a.meta.block_tables, b.meta.block_tables)
    assert torch.equal(a.meta.slot_mapping, b.meta.slot_mapping)
