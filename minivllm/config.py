"""The engine's configuration: a tree of dataclasses, validated once at the edge.

Each component receives only its slice (the scheduler never sees the model's HF config).
`engine/config_builder.build_engine_config(**kwargs)` is the one place that reads the model's
config from disk to resolve defaults such as max_model_len; constructors do no I/O. This module
imports nothing from engine/ (the builder depends on the config, not the other way round).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from minivllm.lora.config import LoRAConfig
from minivllm.models.arch import ArchConfig
from minivllm.pooling_params import PoolerConfig
from minivllm.quant.config import QuantConfig
from minivllm.spec_decode.config import SpeculativeConfig

_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None  # path to a GGUF file or HF directory; None = bundled SmolLM2
    source_kind: str  # "gguf" or "hf"
    source_path: str
    served_name: str
    arch: ArchConfig
    dtype: str  # resolved: float32 / float16 / bfloat16
    load_format: str = "auto"  # auto | dummy
    max_model_len: int = 2048
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    chat_template: str | None = None  # overrides the model's own
    seed: int = 0
    quantization: QuantConfig | None = None  # quantized linear layers (quant/config.py)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # explicit KV budget (the CPU's default is 1 GiB)
    num_kv_blocks: int | None = None  # explicit override of the block count (tests)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 (e4m3, per-tensor scales)
    calculate_kv_scales: bool = False  # fp8: scales from the first step's K/V (else checkpoint or 1.0)
    prefix_caching_hash_algo: str = "sha256"  # or "xxhash" (core/block_hash.py)
    # KV in host memory (kv_transfer/): swap preemption's pool (swap_space GiB), its mode ("swap",
    # "recompute", None: per request by cost) and the prefix cache's offload tier (kv_offloading_size GiB)
    swap_space_bytes: int = 0
    preemption_mode: str | None = None
    kv_offloading_bytes: int = 0
    # several models on one GPU (server/multi_model.py): gpu_memory_utilization is this engine's
    # share of the GPU, and memory other processes held when it started is not its to count
    kv_budget_own_process: bool = False


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    # prompt tokens per step while requests are decoding and few wait (None: no limit); see
    # SchedulerLimits.max_prefill_tokens_with_decodes
    max_prefill_tokens_with_decodes: int | None = None


EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """vLLM's names. One engine core (replica) runs world_size = tp x pp ranks; data_parallel_size
    replicas run behind one LLM or API server, each with its own scheduler and KV cache."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # uni: the runner in the engine's own process (world size 1 only); mp: one spawned worker
    # process per rank; ray: one Ray actor per rank, placed with a placement group (multi-node)
    distributed_executor_backend: str = "uni"
    data_parallel_rank: int = 0  # which replica this engine core is (its devices follow it)
    # a MoE model's experts split over the ranks (models/moe.py): the tp ranks of one replica, or
    # with data_parallel_size > 1 every rank of every replica (one world, all_to_all dispatch)
    enable_expert_parallel: bool = False
    # the port the replicas' ranks meet on when one world spans them (set by engine/dp_engine.py)
    data_parallel_master_port: int | None = None
    # True: NCCL for every all-reduce; False: decode-sized ones through symmetric memory where it
    # works (distributed/symm_all_reduce.py; vLLM's name for its own custom all-reduce switch)
    disable_custom_all_reduce: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def spans_replicas(self) -> bool:
        """Every replica's ranks in one torch.distributed world, stepping in lock-step."""
        return self.enable_expert_parallel and self.data_parallel_size > 1


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured outputs (vLLM's structured_outputs_config): the grammar backend, and the
    reasoning parser whose end marker starts the constraint (None: constrain from the first token)."""

    backend: str = "xgrammar"
    reasoning_parser: str | None = None


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# kv_transfer/connector.py's registry (names only here: this module imports no torch)
KV_CONNECTORS = ("HostConnector", "CudaIpcConnector")


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated prefill/decode (vLLM's kv_transfer_config and field names). A producer
    (prefill instance) computes prompts and serves their KV blocks; a consumer (decode instance)
    pulls them and continues. kv_connector: the transport (kv_transfer/connector.py; None: CUDA
    IPC on a GPU, with the host transport as its fallback, else the host transport); kv_ip /
    kv_port: where a producer listens for block reads (port 0: any free port);
    kv_buffer_device: where a consumer stages pulled blocks ("cpu" or "cuda");
    kv_connector_extra_config: send_timeout_s (how long a producer keeps unpulled blocks, default
    120) and pull_timeout_s (a consumer's socket timeout, default 30)."""

    kv_role: str
    kv_connector: str | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_buffer_device: str = "cpu"
    kv_connector_extra_config: dict = field(default_factory=dict)
    engine_id: str | None = None  # this instance's id in kv_transfer_params (None: a random one)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def send_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("send_timeout_s", 120.0))

    @property
    def pull_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("pull_timeout_s", 30.0))


_EXTRA_KEYS = ("send_timeout_s", "pull_timeout_s")


def parse_kv_transfer_config(value) -> KVTransferConfig | None:
    """A dict, a JSON string, a KVTransferConfig or None -> a validated KVTransferConfig;
    errors name the field (kv_transfer_config.<field>)."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from None
    _kv_check(isinstance(value, dict), "", f"must be a dict or a JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(KVTransferConfig)}
    unknown = sorted(set(value) - known)
    _kv_check(not unknown, unknown[0] if unknown else "", f"is not a kv_transfer_config field (known: {sorted(known)})")
    _kv_check("kv_role" in value, "kv_role", f"is required: one of {list(KV_ROLES)}")
    cfg = KVTransferConfig(**value)
    _kv_check(cfg.kv_role in KV_ROLES, "kv_role", f"must be one of {list(KV_ROLES)}, got {cfg.kv_role!r}")
    _kv_check(cfg.kv_connector is None or cfg.kv_connector in KV_CONNECTORS, "kv_connector",
              f"must be one of {list(KV_CONNECTORS)} (or left out), got {cfg.kv_connector!r}")
    _kv_check(cfg.kv_rank is None or (isinstance(cfg.kv_rank, int) and cfg.kv_rank >= 0), "kv_rank",
              f"must be an integer >= 0, got {cfg.kv_rank!r}")
    _kv_check(isinstance(cfg.kv_parallel_size, int) and cfg.kv_parallel_size >= 1, "kv_parallel_size",
              f"must be an integer >= 1, got {cfg.kv_parallel_size!r}")
    _kv_check(isinstance(cfg.kv_ip, str) and bool(cfg.kv_ip), "kv_ip", f"must be a host name or address, got {cfg.kv_ip!r}")
    _kv_check(isinstance(cfg.kv_port, int) and 0 <= cfg.kv_port <= 65535, "kv_port",
              f"must be an integer in [0, 65535] (0: any free port), got {cfg.kv_port!r}")
    _kv_check(cfg.kv_buffer_device in ("cpu", "cuda"), "kv_buffer_device",
              f"must be 'cpu' or 'cuda', got {cfg.kv_buffer_device!r}")
    extra = cfg.kv_connector_extra_config
    _kv_check(isinstance(extra, dict), "kv_connector_extra_config", f"must be an object, got {type(extra).__name__}")
    for key, v in extra.items():
        _kv_check(key in _EXTRA_KEYS, f"kv_connector_extra_config.{key}", f"is not a known key (known: {list(_EXTRA_KEYS)})")
        _kv_check(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
                  f"kv_connector_extra_config.{key}", f"must be a number > 0, got {v!r}")
    _kv_check(cfg.engine_id is None or (isinstance(cfg.engine_id, str) and cfg.engine_id), "engine_id",
              f"must be a non-empty string, got {cfg.engine_id!r}")
    return cfg


def _kv_check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"kv_transfer_config.{name} {msg}" if name else f"kv_transfer_config {msg}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"
    enforce_eager: bool = False
    attention_backend: str = "torch"
    # schedule step N+1 while step N runs on the device (default: on for CUDA)
    async_scheduling: bool = False
    speculative: SpeculativeConfig | None = None  # speculative decoding (spec_decode/config.py)
    lora: LoRAConfig | None = None  # multi-LoRA (enable_lora); None: no adapters
    pooler: PoolerConfig = field(default_factory=PoolerConfig)  # embeddings: pooling type, normalize
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # every request's result bitwise independent of the batch (models/batch_invariant.py)
    batch_invariant: bool = False
    kv_transfer: KVTransferConfig | None = None  # disaggregated prefill/decode (None: off)


def check(ok: bool, field_name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{field_name} {msg}")
