"""The per-expert token counts reach Prometheus: minivllm:moe_expert_tokens_total{expert} from
the engine's stats snapshot (MoE models only)."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import CollectorRegistry, generate_latest

from minivllm.engine.llm_engine import EngineStats
from minivllm.server.metrics import _EngineStatsCollector


class _Engine:
    def __init__(self, stats: EngineStats) -> None:
        self.stats = stats

    def get_stats(self) -> EngineStats:
        return self.stats


def _scrape(stats: EngineStats) -> str:
    reg = CollectorRegistry()
    reg.register(_EngineStatsCollector(_Engine(stats), "m"))
    return generate_latest(reg).decode()


def test_expert_token_counts_exposed_for_moe_only():
    dense = EngineStats(1, 0, 0.5, 10, 5, 0, 0, 0, 7, 3)
    assert "moe_expert_tokens" not in _scrape(dense)
    text = _scrape(replace(dense, expert_token_counts=(4, 0, 9)))
    lines = [li for li in text.splitlines() if li.startswith("minivllm:moe_expert_tokens_total")]
    assert lines == ['minivllm:moe_expert_tokens_total{expert="0",model_name="m"} 4.0',
                     'minivllm:moe_expert_tokens_total{expert="1",model_name="m"} 0.0',
                     'minivllm:moe_expert_tokens_total{expert="2",model_name="m"} 9.0']
    assert "vllm:generation_tokens_total" in text
