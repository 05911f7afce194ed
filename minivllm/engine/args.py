"""Engine options as command-line flags, shared by `generate`, `chat`, `serve` and `bench`."""

from __future__ import annotations

import argparse
import json


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", action="append", default=None,
                   help="GGUF file or HF directory (default: bundled SmolLM2-135M-Instruct); `minivllm serve` "
                        "takes it several times: several models, each with its own engine and KV pool")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory or GGUF file (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--seed", type=int, default=None, help="engine seed; also the sampling seed of generate/chat")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None,
                   help="prompt tokens per step while requests decode and few wait, to bound inter-token "
                        "latency (default: 1024 for `serve` on a GPU, else no cap; 0: no cap)")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the current one runs (default: on for CUDA)")
    g.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
    g.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON, vLLM\'s fields, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 5}\' (methods: ngram, suffix, '
                        'layer_skip with num_layers, medusa with model; a "model" alone: a draft model)')
    g.add_argument("--quantization", "-q", default=None, choices=["awq", "gptq", "compressed-tensors", "fp8"],
                   help="quantized weights: default the checkpoint's quantization_config; fp8 also quantizes an "
                        "unquantized model while loading")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache element type: auto = the model's dtype; fp8 = e4m3 with per-tensor scales")
    g.add_argument("--calculate-kv-scales", action="store_true",
                   help="with --kv-cache-dtype fp8: per-layer scales from the first step's K/V (else the "
                        "checkpoint's, or 1.0)")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT directories)")
    g.add_argument("--max-loras", type=int, default=1, help="adapters one step may mix (device slots)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded on the host (default: --max-loras)")
    g.add_argument("--pooler-config", default=None,
                   help='embeddings: JSON, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
                        '(default: LAST token, normalized)')
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks each layer is split over (heads, MLP features, vocabulary)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages, each a contiguous range of layers")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas behind one server, requests routed to the least loaded one")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="a MoE model's experts split over the ranks (whole experts: E / (tp x dp) each); with "
                        "-dp > 1 tokens travel to their experts' replicas by all_to_all")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="NCCL for every tensor-parallel all-reduce (default: decode-sized ones through "
                        "symmetric memory, one kernel over NVLink, where the GPUs allow it)")
    g.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                   help="uni: in process (world size 1); mp: one worker process per rank; ray: Ray actors, "
                        "also on other nodes of a Ray cluster (default: uni for one rank, else mp)")
    from minivllm.reasoning import REASONING_PARSERS
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split <think>...</think> into reasoning_content; structured output then constrains "
                        "only what follows the reasoning section")
    g.add_argument("--structured-outputs-config", type=json.loads, default=None,
                   help='structured outputs options as JSON, e.g. \'{"backend": "xgrammar"}\'')
    g.add_argument("--prefix-caching-hash-algo", default="sha256", choices=["sha256", "xxhash"],
                   help="block hash of the prefix cache: sha256 (default) or xxhash (faster, not cryptographic)")
    g.add_argument("--swap-space", type=float, default=None,
                   help="GiB of host memory per engine for preempted requests' KV (swap preemption; default 0, "
                        "4 with --preemption-mode swap)")
    g.add_argument("--preemption-mode", default=None, choices=["swap", "recompute"],
                   help="how a preempted request gives back its KV blocks (default: per request, by cost, "
                        "swapping while --swap-space has room)")
    g.add_argument("--kv-offloading-size", type=float, default=None,
                   help="GiB of host memory that keeps blocks evicted from the prefix cache (CPU offload tier)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="bitwise the same result for a request whatever else is batched with it (slower; "
                        "VLLM_BATCH_INVARIANT=1 does the same)")
    g.add_argument("--kv-transfer-config", default=None,
                   help='disaggregated prefill/decode as JSON, vLLM\'s fields, e.g. \'{"kv_role": "kv_producer"}\' '
                        '(kv_producer: a prefill instance, kv_consumer: a decode instance; put them behind '
                        '`minivllm router`)')
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer: prompts must be token ids and outputs carry token ids, no text")


_KEYS = ["model", "tokenizer", "dtype", "device", "load_format", "seed", "max_model_len", "block_size",
         "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill",
         "gpu_memory_utilization", "kv_cache_memory_bytes", "num_kv_blocks", "scheduling_policy",
         "enforce_eager", "attention_backend", "chat_template", "async_scheduling",
         "skip_tokenizer_init", "max_prefill_tokens_with_decodes", "quantization", "kv_cache_dtype",
         "calculate_kv_scales", "speculative_config", "reasoning_parser", "structured_outputs_config",
         "prefix_caching_hash_algo", "batch_invariant", "tensor_parallel_size", "pipeline_parallel_size",
         "data_parallel_size", "distributed_executor_backend", "enable_expert_parallel",
         "disable_custom_all_reduce", "swap_space", "preemption_mode", "kv_offloading_size", "enable_lora",
         "max_loras", "max_lora_rank", "max_cpu_loras", "pooler_config", "kv_transfer_config"]


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {k: getattr(args, k) for k in _KEYS if hasattr(args, k)}
    models = kwargs.get("model")
    if isinstance(models, list):  # (--model appends)
        if len(models) > 1:
            raise ValueError(f"--model was given {len(models)} times: only `minivllm serve` serves several models")
        kwargs["model"] = models[0]
    if kwargs.get("seed") is None:
        kwargs["seed"] = 0
    return kwargs
