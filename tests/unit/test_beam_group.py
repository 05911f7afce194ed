"""BeamGroup (core/beam.py): vLLM's beam-search rule on hand-made candidate lists, pure Python."""

from __future__ import annotations

import math

from minivllm.core.beam import BeamGroup, beam_score
from minivllm.core.interfaces import TokenLogprobs
from minivllm.core.request import Request
from minivllm.sampling_params import BeamSearchParams, SamplingParams

EOS = 2


def _beam(group: BeamGroup, tokens: list[int]) -> Request:
    return Request(group.new_beam_id(), tokens, SamplingParams(), frozenset({EOS}), 0.0, 8, beam=group)


def _lp(pairs: list[tuple[int, float]]) -> TokenLogprobs:
    return TokenLogprobs([t for t, _ in pairs], [v for _, v in pairs], 1)


def test_select_keeps_best_non_eos_and_completes_eos():
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    g = BeamGroup("r", params, 3, frozenset({EOS}))
    a = _beam(g, [5, 6, 7])
    g.add_root(a)
    # eos is the most likely token: it completes a hypothesis but does not take a beam
    g.report(a, _lp([(EOS, -0.1), (10, -1.0), (11, -2.0), (12, -3.0)]))
    assert g.all_reported
    keep = g.select()
    assert [c.token_id for c in keep] == [10, 11]
    assert [h.token_ids for h in g.completed] == [[EOS]]
    # its score leaves the eos out of the length (vLLM's get_beam_search_score)
    assert math.isclose(g.completed[0].score, -0.1 / 3)
    assert g.completed[0].finish_reason == "stop"


def test_ignore_eos_keeps_eos_as_a_beam_and_finish_ranks_by_length_penalty():
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True, length_penalty=2.0)
    g = BeamGroup("r", params, 2, frozenset({EOS}))
    a = _beam(g, [5, 6])
    g.add_root(a)
    g.report(a, _lp([(EOS, -0.1), (10, -1.0), (10, -5.0)]))  # duplicates collapse (first kept)
    keep = g.select()
    assert [(c.token_id, c.cum_logprob) for c in keep] == [(EOS, -0.1), (10, -1.0)]
    g.finish(keep)
    assert [h.token_ids for h in g.result] == [[EOS], [10]]
    assert all(h.finish_reason == "length" for h in g.result)
    assert math.isclose(g.result[0].score, beam_score(3, -0.1, True, 2.0))


def test_two_beams_candidates_ranked_together():
    params = BeamSearchParams(beam_width=2, max_tokens=8)
    g = BeamGroup("r", params, 1, frozenset({EOS}))
    root = _beam(g, [1])
    g.add_root(root)
    g.report(root, _lp([(3, -0.5), (4, -0.7), (5, -3.0), (6, -4.0)]))
    first = g.select()
    b1, b2 = _beam(g, [1, 3]), _beam(g, [1, 4])
    g.set_live([(b1, first[0]), (b2, first[1])])
    assert not g.all_reported
    g.report(b1, _lp([(7, -2.0), (8, -2.1)]))
    assert not g.all_reported
    g.report(b2, _lp([(9, -0.1), (EOS, -0.2)]))
    keep = g.select()
    # b2's 9 (-0.8) beats b1's 7 (-2.5); b2's eos (-0.9) completes; then b1's 7 (-2.5)
    assert [(c.parent is b2, c.token_id) for c in keep] == [(True, 9), (False, 7)]
    assert [h.token_ids for h in g.completed] == [[4, EOS]]
    g.finish(keep)
    # completed and last beams ranked together by score (length_penalty 1: cum / length)
    assert [h.token_ids for h in g.result] == [[4, 9], [4, EOS]]
