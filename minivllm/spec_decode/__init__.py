"""Speculative decoding: proposers (n-gram, suffix, draft model, layer skip, Medusa heads) and the
verification that keeps the target's output distribution; the scheduler and the runner see only
"k draft tokens per request". Entered through make_speculator (the runner) and
SpeculativeConfig (the engine's configuration)."""

from __future__ import annotations

from minivllm.spec_decode.config import SpeculativeConfig, parse_speculative_config

__all__ = ["SpeculativeConfig", "make_speculator", "parse_speculative_config"]


def make_speculator(config: SpeculativeConfig, runner):
    """The Speculator for `config` on the runner's loaded target model (a draft model or Medusa
    heads are loaded here; a draft model's KV cache comes with the runner's, see ModelRunner)."""
    from minivllm.spec_decode.speculator import Speculator
    return Speculator(config, _make_proposer(config, runner))


def _make_proposer(config: SpeculativeConfig, runner):
    method = config.method
    if method == "ngram":
        from minivllm.spec_decode.ngram import NgramProposer
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if method == "suffix":
        from minivllm.spec_decode.suffix import SuffixProposer
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    from minivllm.spec_decode.model_proposer import ModelProposer
    max_len, bs = runner.config.scheduler.max_model_len, runner.block_size
    if method == "layer_skip":
        return ModelProposer(runner.model, bs, runner.device, max_len, num_layers=config.num_layers)
    if method == "draft_model":
        from minivllm.spec_decode.draft_model import load_draft_model
        return ModelProposer(load_draft_model(config.model, runner), bs, runner.device, max_len)
    from minivllm.spec_decode.medusa import MedusaProposer, load_medusa_heads
    arch = runner.arch
    heads = load_medusa_heads(config.model, arch.hidden_size, arch.vocab_size, runner.device, runner.dtype)
    heads.shared_lm_head = runner.model.lm_head
    return MedusaProposer(heads)
