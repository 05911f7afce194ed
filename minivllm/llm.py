"""The offline API, mirroring vLLM's: LLM(...).generate(...) and LLM(...).chat(...)."""

from __future__ import annotations

from collections.abc import Sequence

from minivllm.engine.gc_heap import unfreeze_heap
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.input_processor import PromptInput
from minivllm.lora.request import LoRARequest
from minivllm.outputs import BeamSearchOutput, BeamSearchSequence, EmbeddingRequestOutput, RequestOutput
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Conversation = list[dict]


class LLM:
    """An engine for offline batches. With model=None it runs the bundled SmolLM2-135M-Instruct.

    Keyword arguments (all optional): tokenizer, dtype ("auto", "float32", "float16",
    "bfloat16"), device ("auto", "cpu", "cuda"), load_format ("auto" or "dummy"), seed,
    max_model_len, block_size (16), max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching (True), gpu_memory_utilization (0.9), kv_cache_memory_bytes,
    num_kv_blocks, scheduling_policy ("fcfs" or "priority"), enable_chunked_prefill,
    enforce_eager, attention_backend ("torch" or "triton"), skip_tokenizer_init, chat_template,
    structured_outputs_config ({"backend": "xgrammar"}), reasoning_parser ("qwen3" or
    "deepseek_r1": structured output then constrains only what follows the reasoning section).
    A request's output constraint is SamplingParams(structured_outputs=StructuredOutputsParams(...)).
    enable_lora, max_loras (1), max_lora_rank (16), max_cpu_loras (max_loras); pooler_config
    ({"pooling_type": "LAST" or "MEAN", "normalize": True}).
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.llm_engine = LLMEngine.from_kwargs(model=model, **kwargs)

    def __del__(self) -> None:
        # the engine froze the startup heap (engine/gc_heap.py): unfreeze it, so that `del llm;
        # gc.collect()` frees the engine's cycles and its GPU memory, as it does in vLLM. (At
        # interpreter exit the module's globals may already be gone: nothing to free then.)
        if unfreeze_heap is not None:
            unfreeze_heap()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the order of the prompts.
        lora_request: one adapter for every prompt, or one (or None) per prompt."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority must have one entry per prompt ({len(prompts)}), got {len(priority)}")
        ids = self._add_all(prompts, params, priority, _as_lora_list(lora_request, len(prompts)))
        return self._run(ids, use_tqdm)

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search over every prompt (vLLM's API): the beam_width best sequences of each,
        best first. The beams run in the engine like other sequences, sharing KV blocks."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam_search needs BeamSearchParams, got {type(params).__name__}")
        prompts = _as_prompt_list(prompts)
        ids = self._add_all(prompts, [params] * len(prompts), None, _as_lora_list(lora_request, len(prompts)))
        return [_beam_output(out) for out in self._run(ids, use_tqdm)]

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt: the model's final hidden states pooled (LAST token or MEAN,
        the engine's pooler_config unless the params say) and normalized."""
        prompts = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"pooling_params must be one PoolingParams or one per prompt ({len(prompts)}), "
                                 f"got {len(params)}")
        ids = self._add_all(prompts, params, None, _as_lora_list(lora_request, len(prompts)))
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Formats each conversation with the model's chat template, then generates."""
        from minivllm.engine.tokenizer import apply_chat_template
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer (the engine was started with skip_tokenizer_init)")
        prompts = [{"prompt_token_ids": apply_chat_template(tok, c, add_generation_prompt, chat_template)}
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def _add_all(self, prompts, params, priority, loras=None) -> list[str]:
        engine, ids = self.llm_engine, []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                sp = sp.clone()
                sp.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, at the end
                rid = engine.next_request_id()
                engine.add_request(rid, p, sp, priority=priority[i] if priority else 0,
                                   lora_request=loras[i] if loras else None)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)  # the batch is refused as a whole; the engine keeps serving
            while engine.has_unfinished_requests():
                engine.step()
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(ids)) if use_tqdm else None
        generated = 0
        while len(finished) < len(wanted) and engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in wanted:
                    finished[out.request_id] = out
                    if isinstance(out, RequestOutput):
                        generated += sum(len(o.token_ids) for o in out.outputs)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(f"{generated / max(bar.format_dict['elapsed'], 1e-6):.0f} tok/s out")
        if bar is not None:
            bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    if not prompts:
        raise ValueError("prompts is empty")
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params must be one SamplingParams or one per prompt ({n}), got {len(params)}")
    return params


def _as_lora_list(lora, n: int) -> list[LoRARequest | None] | None:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n if lora is not None else None
    lora = list(lora)
    if len(lora) != n:
        raise ValueError(f"lora_request must be one LoRARequest or one per prompt ({n}), got {len(lora)}")
    return lora


def _beam_output(out: RequestOutput) -> BeamSearchOutput:
    return BeamSearchOutput([BeamSearchSequence(list(out.prompt_token_ids) + o.token_ids, o.logprobs or [],
                                                o.cumulative_logprob or 0.0, o.text, o.finish_reason, o.stop_reason)
                             for o in out.outputs])


def _progress_bar(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
