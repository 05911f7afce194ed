"""The standard workloads of BENCHMARKS.md (W1, W1-8B, W2, W4, W5) as plain data.

Every engine runner (minivllm, vLLM, Hugging Face transformers) consumes the same objects:
token-id lists and per-request sampling parameters as plain dicts (the keyword arguments of
both minivllm's and vLLM's `SamplingParams`). Pure Python: no torch, no minivllm engine import,
so the vLLM process can import it too.

W1 reproduces nano-vllm's bench.py draw for draw: `random.seed(0)`, then 256 prompts of
`randint(100, 1024)` tokens drawn from `randint(0, 10000)`, THEN 256 `max_tokens` of
`randint(100, 1024)` (prompts first, then max_tokens). A private `random.Random(0)` yields the
same sequence as the module-level functions after `random.seed(0)` without touching the
global state. Total output tokens: 133,966.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

W1_NUM_REQUESTS = 256
W1_EXPECTED_OUTPUT_TOKENS = 133_966
W1_TOKEN_RANGE = (0, 10000)
W1_LEN_RANGE = (100, 1024)
W1_MAX_MODEL_LEN = 4096

W2_PROMPT_LEN = 128
W2_OUTPUT_LEN = 256
W2_SEED = 1234  # the seed ../shared/peers/vllm-0.20.0/bench_w1.py used for its batch-1 prompt

W4_NUM_REQUESTS = 256
W4_PREFIX_LEN = 2000
W4_SUFFIX_LEN = 64
W4_OUTPUT_LEN = 128
W4_SEED = 0

W5_NUM_PROMPTS = 32
W5_LEN_RANGE = (20, 200)
W5_OUTPUT_LEN = 128
W5_SEED = 0

# the short warm-up request every runner sends before timing (nano-vllm's "Benchmark: ")
WARMUP_PROMPT = [33, 47, 2828, 25, 220]
WARMUP_PARAMS = {"max_tokens": 16}

# workload name -> bundled model config (minivllm/bench/configs/<name>/config.json)
DEFAULT_MODEL = {"W1": "qwen3-0.6b", "W1-8B": "qwen3-8b", "W2": "llama-3.1-8b", "W4": "qwen3-8b",
                 "W6": "qwen3-0.6b", "W10": "qwen3-30b-a3b", "W10-decode": "qwen3-30b-a3b", "W12": "qwen3-8b"}


@dataclass
class Workload:
    name: str
    model_config: str
    prompts: list[list[int]]
    params: list[dict]  # SamplingParams keyword arguments, one dict per request
    max_model_len: int
    description: str
    expected_output_tokens: int | None = None  # the exact total when ignore_eos holds
    meta: dict = field(default_factory=dict)  # scaling, remapping, shared-prefix length, ...

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.params):
            raise ValueError(f"{self.name}: {len(self.prompts)} prompts but {len(self.params)} params")

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def total_max_tokens(self) -> int:
        return sum(p["max_tokens"] for p in self.params)

    def prompt_inputs(self) -> list[dict]:
        """The prompts in the form both engines take: {"prompt_token_ids": [...]}."""
        return [{"prompt_token_ids": list(p)} for p in self.prompts]

    def scaled(self, num_requests: int | None = None, max_output: int | None = None,
               max_prompt: int | None = None) -> Workload:
        """A smaller copy for smoke tests: the first num_requests requests of the full draw,
        max_tokens clamped to max_output, prompts cut to max_prompt tokens."""
        if num_requests is None and max_output is None and max_prompt is None:
            return self
        n = self.num_requests if num_requests is None else num_requests
        if not 1 <= n <= self.num_requests:
            raise ValueError(f"num_requests must be in [1, {self.num_requests}], got {n}")
        prompts = [list(p[:max_prompt] if max_prompt else p) for p in self.prompts[:n]]
        params = [dict(p) for p in self.params[:n]]
        if max_output is not None:
            if max_output < 1:
                raise ValueError(f"max_output must be >= 1, got {max_output}")
            for p in params:
                p["max_tokens"] = min(p["max_tokens"], max_output)
        meta = dict(self.meta, scaled={"num_requests": num_requests, "max_output": max_output,
                                       "max_prompt": max_prompt})
        return replace(self, prompts=prompts, params=params, expected_output_tokens=sum(p["max_tokens"] for p in params),
                       meta=meta)

    def fit_vocab(self, vocab_size: int) -> Workload:
        """Token ids taken modulo vocab_size when the model's vocabulary is smaller than the
        workload's id range (only the tiny smoke-test config); recorded in meta."""
        if all(t < vocab_size for p in self.prompts for t in p):
            return self
        prompts = [[t % vocab_size for t in p] for p in self.prompts]
        return replace(self, prompts=prompts, meta=dict(self.meta, token_ids_mod_vocab=vocab_size))

    def summary(self) -> dict:
        lens = [len(p) for p in self.prompts]
        return {"name": self.name, "model_config": self.model_config, "num_requests": self.num_requests,
                "prompt_tokens": sum(lens), "prompt_len_min": min(lens), "prompt_len_max": max(lens),
                "max_tokens_total": self.total_max_tokens, "expected_output_tokens": self.expected_output_tokens,
                "max_model_len": self.max_model_len, "description": self.description, **self.meta}


# ---- W1: offline throughput (nano-vllm bench.py) ------------------------------------------------
def w1_draw(seed: int = 0, num_requests: int = W1_NUM_REQUESTS) -> tuple[list[list[int]], list[int]]:
    """(prompts, max_tokens) in bench.py's draw order: all prompts first, then all max_tokens."""
    rng = random.Random(seed)
    lo, hi = W1_TOKEN_RANGE
    prompts = [[rng.randint(lo, hi) for _ in range(rng.randint(*W1_LEN_RANGE))] for _ in range(num_requests)]
    max_tokens = [rng.randint(*W1_LEN_RANGE) for _ in range(num_requests)]
    return prompts, max_tokens


def w1(model_config: str | None = None, name: str = "W1") -> Workload:
    prompts, max_tokens = w1_draw()
    total = sum(max_tokens)
    assert total == W1_EXPECTED_OUTPUT_TOKENS, f"W1 draw gives {total} output tokens, expected 133,966"
    params = [{"temperature": 0.6, "ignore_eos": True, "max_tokens": m} for m in max_tokens]
    return Workload(name, model_config or DEFAULT_MODEL.get(name, "qwen3-0.6b"), prompts, params, W1_MAX_MODEL_LEN,
                    "256 random prompts U[100,1024] of ids U[0,10000], max_tokens U[100,1024], T=0.6, ignore_eos "
                    "(random.seed(0); prompts drawn first, then max_tokens)", W1_EXPECTED_OUTPUT_TOKENS)


# ---- W2: batch-1 latency ----------------------------------------------------------------------------
def w2(model_config: str | None = None, name: str = "W2") -> Workload:
    """W2 (and W10-decode: the same request on Qwen3-30B-A3B's shapes)."""
    rng = random.Random(W2_SEED)
    prompt = [rng.randint(*W1_TOKEN_RANGE) for _ in range(W2_PROMPT_LEN)]
    params = [{"temperature": 0.0, "ignore_eos": True, "max_tokens": W2_OUTPUT_LEN}]
    return Workload(name, model_config or DEFAULT_MODEL[name], [prompt], params, W1_MAX_MODEL_LEN,
                    "one 128-token random prompt (Random(1234), ids U[0,10000]), 256 output tokens, greedy, ignore_eos",
                    W2_OUTPUT_LEN)


def first_token_params(params: dict) -> dict:
    """The same request cut to one output token: its wall time is the TTFT probe."""
    return dict(params, max_tokens=1)


# ---- W4: shared prefix --------------------------------------------------------------------------------
def w4(model_config: str | None = None) -> Workload:
    rng = random.Random(W4_SEED)
    prefix = [rng.randint(*W1_TOKEN_RANGE) for _ in range(W4_PREFIX_LEN)]
    suffixes = [[rng.randint(*W1_TOKEN_RANGE) for _ in range(W4_SUFFIX_LEN)] for _ in range(W4_NUM_REQUESTS)]
    assert len({tuple(s) for s in suffixes}) == W4_NUM_REQUESTS, "W4 suffixes must be unique"
    prompts = [prefix + s for s in suffixes]
    params = [{"temperature": 0.0, "ignore_eos": True, "max_tokens": W4_OUTPUT_LEN} for _ in prompts]
    return Workload("W4", model_config or DEFAULT_MODEL["W4"], prompts, params, W1_MAX_MODEL_LEN,
                    "256 requests = one shared random 2,000-token prefix + a unique random 64-token suffix "
                    "(Random(0), ids U[0,10000]); 128 output tokens each, greedy, ignore_eos; prefix cache cold",
                    W4_NUM_REQUESTS * W4_OUTPUT_LEN, {"shared_prefix_len": W4_PREFIX_LEN, "suffix_len": W4_SUFFIX_LEN})


# ---- W12: KV pressure (16 shared prefixes, more than the device KV cache holds) ------------------------
W12_NUM_PREFIXES = 16
W12_NUM_REQUESTS = 512
W12_SEED = 12


def w12(model_config: str | None = None) -> Workload:
    rng = random.Random(W12_SEED)
    prefixes = [[rng.randint(*W1_TOKEN_RANGE) for _ in range(W4_PREFIX_LEN)] for _ in range(W12_NUM_PREFIXES)]
    prompts = [prefixes[i % W12_NUM_PREFIXES] + [rng.randint(*W1_TOKEN_RANGE) for _ in range(W4_SUFFIX_LEN)]
               for i in range(W12_NUM_REQUESTS)]  # round-robin over the prefixes
    params = [{"temperature": 0.0, "ignore_eos": True, "max_tokens": W4_OUTPUT_LEN} for _ in prompts]
    return Workload("W12", model_config or DEFAULT_MODEL["W12"], prompts, params, W1_MAX_MODEL_LEN,
                    "512 requests = one of 16 random 2,000-token prefixes in round-robin order + a unique random "
                    "64-token suffix (Random(12)); 128 output tokens, greedy, ignore_eos; run with a KV cache that "
                    "holds about 4 prefixes (kv_cache_memory_bytes)", W12_NUM_REQUESTS * W4_OUTPUT_LEN,
                    {"shared_prefix_len": W4_PREFIX_LEN, "num_prefixes": W12_NUM_PREFIXES, "suffix_len": W4_SUFFIX_LEN})


# ---- W5: CPU default (real SmolLM2, chat prompts) -------------------------------------------------------
W5_SYSTEM = "You are a helpful assistant."
W5_QUESTIONS = [
    "What is the capital of France?", "Write a haiku about autumn.", "Explain photosynthesis.",
    "List three prime numbers.", "Hi!", "Translate 'good morning' to Spanish.", "Summarize the text below.",
    "What is 2+2?", "Give me a recipe for pancakes.", "Why is the sky blue?", "Name a famous painter.",
    "How do airplanes fly?", "Tell me a short joke.", "What does a compiler do?", "Describe a cat.",
    "How many legs does a spider have?", "Suggest a name for a dog.", "What is gravity?",
    "Write one sentence about the sea.", "Who wrote Hamlet?", "What is the boiling point of water?",
    "Explain recursion simply.", "What is a noun?", "Recommend a book for children.",
    "How do I sort a list in Python?", "What causes rain?", "Define democracy.", "Count from one to five.",
    "What is the largest planet?", "Explain what a CPU is.", "Give two synonyms for happy.",
    "What is the speed of light?",
]
W5_FILLER = (
    "The following passage is background material for the question. Rivers carry water from the mountains to "
    "the sea, shaping valleys, feeding farms and supporting towns along their banks. Over centuries people built "
    "bridges, mills and harbours, and trade grew with every new road. Scientists measure the flow of water, the "
    "amount of sediment and the temperature through the seasons, and they compare the records of many years to "
    "understand floods and droughts. Teachers use such stories to explain geography, history and economics "
    "together, because the life of a region depends on its water, its soil and the work of its people. "
)


def w5_target_lengths(seed: int = W5_SEED) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(*W5_LEN_RANGE) for _ in range(W5_NUM_PROMPTS)]


def w5_conversation(i: int, filler_words: int) -> list[dict]:
    words = (W5_FILLER * 4).split()[:filler_words]
    user = W5_QUESTIONS[i % len(W5_QUESTIONS)] + ("\n\n" + " ".join(words) if words else "")
    return [{"role": "system", "content": W5_SYSTEM}, {"role": "user", "content": user}]


def w5(encode) -> Workload:
    """32 chat prompts; encode(messages) -> token ids (the model's chat template). Each prompt
    takes the fewest filler words that bring it to its target length in [20, 200] tokens."""
    prompts, convs = [], []
    max_words = len((W5_FILLER * 4).split())
    for i, target in enumerate(w5_target_lengths()):
        lo, hi = 0, max_words  # smallest word count whose encoding reaches the target
        while lo < hi:
            mid = (lo + hi) // 2
            if len(encode(w5_conversation(i, mid))) >= target:
                hi = mid
            else:
                lo = mid + 1
        conv = w5_conversation(i, lo)
        ids = encode(conv)
        if len(ids) > W5_LEN_RANGE[1]:  # one word too many tokens: step back under the cap
            conv = w5_conversation(i, max(lo - 1, 0))
            ids = encode(conv)
        prompts.append(list(ids))
        convs.append(conv)
    params = [{"temperature": 0.0, "ignore_eos": True, "max_tokens": W5_OUTPUT_LEN} for _ in prompts]
    return Workload("W5", "SmolLM2-135M-Instruct", prompts, params, 2048,
                    "32 chat prompts (SmolLM2 chat template), lengths 20-200 tokens, 128 output tokens each, "
                    "greedy, ignore_eos", W5_NUM_PROMPTS * W5_OUTPUT_LEN, {"conversations": convs})


def get(name: str, model_config: str | None = None) -> Workload:
    """W1, W1-8B, W2, W4, W10 (W1's request set on Qwen3-30B-A3B) or W10-decode (W2's request
    on Qwen3-30B-A3B); W5 needs a tokenizer: call w5(encode)."""
    if name == "W1":
        return w1(model_config, "W1")
    if name in ("W1-8B", "W10"):
        return w1(model_config or DEFAULT_MODEL[name], name)
    if name in ("W2", "W10-decode"):
        return w2(model_config, name)
    if name == "W4":
        return w4(model_config)
    if name == "W12":
        return w12(model_config)
    raise ValueError(f"workload must be one of W1, W1-8B, W2, W4, W10, W10-decode, W12, got {name!r}")


def warmup_workload(vocab_size: int | None = None) -> tuple[list[dict], list[dict]]:
    ids = [t % vocab_size for t in WARMUP_PROMPT] if vocab_size else list(WARMUP_PROMPT)
    return [{"prompt_token_ids": ids}], [dict(WARMUP_PARAMS)]
