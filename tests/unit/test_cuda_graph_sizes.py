"""Which padded sizes get a CUDA graph (pure Python: runs on the CPU)."""

from minivllm.runner.cuda_graph import MAX_MIXED_TOKENS, graph_batch_sizes, mixed_seq_sizes, mixed_token_sizes


def test_decode_sizes_cover_every_batch_up_to_max_num_seqs():
    for max_seqs in (1, 3, 8, 20, 256, 1024):
        sizes = graph_batch_sizes(max_seqs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_seqs
        for n in range(1, max_seqs + 1):  # padding never above 7 rows (beyond the first few)
            b = next(b for b in sizes if b >= n)
            assert b - n < 8


def test_mixed_sizes_cover_the_step_budget_up_to_the_limit():
    for budget in (1, 64, 100, 200, 2048, 3000, 8192, 16384, 40000):
        sizes = mixed_token_sizes(budget)
        assert sizes == sorted(set(sizes)) and sizes[-1] <= MAX_MIXED_TOKENS
        covered = min(budget, MAX_MIXED_TOKENS)
        assert sizes[-1] >= covered  # every step up to the budget (or the limit) has a graph
        assert all(s < budget for s in sizes[:-1])  # no graph bigger than needed
        for n in range(1, covered + 1):
            t = next(t for t in sizes if t >= n)
            assert t - n < 64 or (n > 1024 and (t - n) / n < 0.125)  # 64 tokens, or 12.5 % above 1,024
    assert mixed_token_sizes(8192)[-8:] == [4608, 5120, 5632, 6144, 6656, 7168, 7680, 8192]


def test_mixed_seq_sizes_hold_every_step_of_their_token_size():
    for tokens in (64, 128, 256, 640, 1024, 2048, 2304, 8192):
        for max_seqs in (1, 100, 256, 1024):
            sizes = mixed_seq_sizes(tokens, max_seqs)
            most = min(tokens, max_seqs)
            assert sizes == sorted(set(sizes)) and sizes[-1] == most  # any step of <= tokens fits
            assert all(s < most for s in sizes[:-1])
            assert len(sizes) == 1 or tokens <= 2048  # large steps: one graph per token size
    # the W3 rate-16 shape: ~110 sequences in a ~700-token step get a 128-sequence graph
    assert next(s for s in mixed_seq_sizes(768, 1024) if s >= 111) == 128
