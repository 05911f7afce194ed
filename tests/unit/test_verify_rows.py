"""A pure verify step of speculative decoding (every request decodes its last token and its
drafts) attends as one-token sequences (runner/input_batch.py): decode-only metadata whose
attention equals the per-request causal attention; any other step keeps per-request metadata."""

from __future__ import annotations

import torch

from minivllm.attention.reference import paged_attention_reference
from minivllm.core.interfaces import ScheduledRequest
from minivllm.runner.input_batch import build_step_inputs

BS = 4


def _verify_step():
    # A: 9 computed, decodes 1 + 3 drafts; B: 5 computed, 1 + 2 drafts; C: 6 computed, no draft
    sched = [ScheduledRequest("A", [11, 12, 13, 14], 9, [], True, num_draft_tokens=3),
             ScheduledRequest("B", [21, 22, 23], 5, [], True, num_draft_tokens=2),
             ScheduledRequest("C", [31], 6, [], True)]
    blocks = {"A": [3, 7, 1, 8], "B": [2, 5], "C": [4, 6]}
    return sched, blocks


def test_verify_step_is_decode_only_with_one_sequence_per_token():
    sched, blocks = _verify_step()
    inputs = build_step_inputs(sched, blocks, BS, torch.device("cpu"), pin=False)
    meta = inputs.meta
    assert meta.is_decode_only and meta.num_seqs == 8
    assert meta.seq_lens.tolist() == [10, 11, 12, 13, 6, 7, 8, 7]  # each token's position + 1
    assert meta.block_tables[:4].tolist() == [[3, 7, 1, 8]] * 4
    assert meta.block_tables[4:7, :2].tolist() == [[2, 5]] * 3
    assert inputs.request_starts == [0, 4, 7, 8]
    assert inputs.logits_indices.tolist() == list(range(8))  # every token is a verify row
    assert inputs.draft_token_ids == [[12, 13, 14], [22, 23], []]


def test_a_step_with_a_prefill_chunk_keeps_per_request_metadata():
    sched, blocks = _verify_step()
    sched.append(ScheduledRequest("D", [41, 42, 43], 0, [], True))  # a prompt
    blocks["D"] = [9]
    inputs = build_step_inputs(sched, blocks, BS, torch.device("cpu"), pin=False)
    assert inputs.meta.num_seqs == 4 and inputs.meta.max_query_len == 4
    assert inputs.meta.query_start_loc.tolist() == inputs.request_starts == [0, 4, 7, 8, 11]


def test_one_token_sequences_attend_like_the_requests():
    torch.manual_seed(0)
    sched, blocks = _verify_step()
    flat = build_step_inputs(sched, blocks, BS, torch.device("cpu"), pin=False).meta
    heads, kv_heads, dim = 4, 2, 8
    k_cache = torch.randn(10, BS, kv_heads, dim)
    v_cache = torch.randn(10, BS, kv_heads, dim)
    query = torch.randn(8, heads, dim)
    per_request = paged_attention_reference(query, k_cache, v_cache, [0, 4, 7, 8], [13, 8, 7],
                                            torch.tensor([[3, 7, 1, 8], [2, 5, 0, 0], [4, 6, 0, 0]]), 0.3)
    per_token = paged_attention_reference(query, k_cache, v_cache, flat.query_start_loc_cpu, flat.seq_lens_cpu,
                                          flat.block_tables, 0.3)
    torch.testing.assert_close(per_token, per_request, rtol=1e-5, atol=1e-5)
