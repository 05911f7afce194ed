"""`minivllm bench parallel-check`'s pieces: layout names, and the agreement figures against tp=1."""

from __future__ import annotations

import argparse

import pytest

from minivllm.bench.parallel_check import compare, parse_layout


def test_layout_names():
    assert parse_layout("tp2") == (2, 1)
    assert parse_layout("pp2") == (1, 2)
    assert parse_layout("tp2pp2") == (2, 2)
    assert parse_layout("tp1") == (1, 1)
    for bad in ("", "dp2", "tp", "2", "pp2tp2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_layout(bad)


def test_agreement_figures():
    ref = {"tokens": [[1, 2, 3, 4], [5, 6, 7, 8]],
           "prompt_lps": [[(-1.0, 10), (-2.0, 11)], [None, (-0.5, 12)]]}
    got = {"tokens": [[1, 2, 9, 4], [5, 6, 7, 8]],  # one position differs in the first output
           "prompt_lps": [[(-1.1, 10), (-2.0, 13)], [None, (-0.25, 12)]]}
    f = compare(ref, got)
    assert f["greedy_position_match_rate"] == 7 / 8
    assert f["greedy_outputs_identical"] == "1/2"
    assert f["mean_first_divergence"] == (2 + 4) / 2
    assert f["prompt_logprob_max_abs_diff"] == 0.25
    assert f["prompt_logprob_mean_abs_diff"] == pytest.approx((0.1 + 0.0 + 0.25) / 3, abs=1e-6)
    assert f["prompt_top1_match_rate"] == pytest.approx(2 / 3, abs=1e-4)
