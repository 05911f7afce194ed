"""SchedulerOutput crosses to the worker ranks pickled as columns (core/interfaces.py,
__reduce__): the round trip gives back every field of every scheduled request, the rare ones
included, and the new requests, finished/preempted ids and KV transfers untouched."""

from __future__ import annotations

import copy
import pickle
import random

from minivllm.core.interfaces import (PLACEHOLDER_TOKEN, KVTransfers, NewRequestData, ScheduledRequest,
                                      SchedulerOutput)
from minivllm.sampling_params import SamplingParams


def _random_output(rng: random.Random, n: int) -> SchedulerOutput:
    scheduled = []
    for i in range(n):
        decode = rng.random() < 0.7
        tokens = [PLACEHOLDER_TOKEN] if decode else [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        s = ScheduledRequest(f"r{i}", tokens, rng.randrange(5000), [rng.randrange(9999) for _ in range(rng.randrange(3))],
                             rng.random() < 0.8)
        if rng.random() < 0.1:
            s.num_draft_tokens = min(len(tokens), rng.randrange(1, 4))
        if rng.random() < 0.1:
            s.prompt_logprob_rows = (rng.randrange(100), rng.randrange(1, 9))
        if rng.random() < 0.05:
            s.pool = True
        if rng.random() < 0.05:
            s.cow = (rng.randrange(8), rng.randrange(999), rng.randrange(999))
        scheduled.append(s)
    new = [NewRequestData("r0", [1, 2, 3], [], SamplingParams(max_tokens=5), 0, frozenset({2}))]
    return SchedulerOutput(new, scheduled, {"gone"}, {"preempted"}, sum(len(s.token_ids) for s in scheduled),
                           KVTransfers(swap_out=[(1, 2)], load=[(3, 4)]))


def test_round_trip_keeps_every_field():
    rng = random.Random(0)
    for n in (0, 1, 7, 256):
        out = _random_output(rng, n)
        back = pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
        assert back == out
        assert [type(s) for s in back.scheduled] == [ScheduledRequest] * n
        # each request owns its lists (the runner extends tables and token lists in place)
        if n > 1:
            assert back.scheduled[0].token_ids is not back.scheduled[1].token_ids


def test_rare_fields_stay_on_their_own_request():
    out = _random_output(random.Random(1), 50)
    out.scheduled[17].cow = (3, 4, 5)
    back = pickle.loads(pickle.dumps(out))
    assert back.scheduled[17].cow == (3, 4, 5)
    assert [s.cow for i, s in enumerate(back.scheduled) if i != 17] == [s.cow for i, s in enumerate(out.scheduled)
                                                                        if i != 17]


def test_deepcopy_and_smaller_message():
    out = _random_output(random.Random(2), 256)
    assert copy.deepcopy(out) == out
    # the column form is what makes the step message small: objects one by one were ~3x larger
    per_object = len(pickle.dumps([(s.req_id, s.token_ids, s.num_computed_tokens, s.new_block_ids, s.samples,
                                    s.num_draft_tokens, s.prompt_logprob_rows, s.pool, s.cow)
                                   for s in out.scheduled]))
    assert len(pickle.dumps(out)) < per_object
