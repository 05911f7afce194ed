"""W5 on the CPU: the real SmolLM2-135M-Instruct (the bundled GGUF), fp32, in one process:

- minivllm: generate over the 32 chat prompts (128 output tokens each, ignore_eos);
- Hugging Face transformers generate on the same GGUF weights: one static left-padded batch
  of the same 32 prompts (min_new_tokens = max_new_tokens = 128, greedy);
- each batch runs --batch-reps times (default 3) and the figure is the median run;
- single-stream decode tok/s of both (and of llama.cpp through llama-cpp-python when it is
  installed): (n - 1) / (median T_n - median T_1) on the first W5 prompt.

    python -m minivllm bench cpu [--num-prompts 32] [--max-output 128] [--skip-hf]
"""

from __future__ import annotations

import os
import statistics
import time

from minivllm.bench import workloads
from minivllm.bench.common import cpu_name, emit, envelope, log, param_bytes
from minivllm.bench.observe import add_observe_args, observe_run


def _decode_rate(t1s: list[float], tns: list[float], n: int) -> dict:
    m1, mn = statistics.median(t1s), statistics.median(tns)
    step = max((mn - m1) / max(n - 1, 1), 1e-9)
    return {"ttft_s": m1, "total_s": mn, "decode_tok_per_s": 1.0 / step, "ms_per_token": 1e3 * step}


def _minivllm(args) -> tuple[dict, workloads.Workload]:
    from minivllm import LLM, SamplingParams
    from minivllm.engine.tokenizer import apply_chat_template
    t = time.perf_counter()
    llm = LLM(dtype="float32", device="cpu", seed=0)
    startup = time.perf_counter() - t
    tok = llm.get_tokenizer()
    wl = workloads.w5(lambda conv: apply_chat_template(tok, conv))
    wl = wl.scaled(args.num_prompts, args.max_output)
    params = [SamplingParams(**p) for p in wl.params]
    llm.generate([wl.prompt_inputs()[0]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    walls = []
    with observe_run(args, llm.llm_engine, "W5 on SmolLM2-135M-Instruct (CPU)"):
        for _ in range(args.batch_reps):  # each from an empty prefix cache: the prompts do not hit
            llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(wl.prompt_inputs(), params, use_tqdm=False)
            walls.append(time.perf_counter() - t)
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            log(f"minivllm W5 batch: {n_out} tokens in {walls[-1]:.2f} s = {n_out / walls[-1]:.1f} tok/s")
    wall = statistics.median(walls)
    single = _single_stream(lambda p: llm.generate([wl.prompt_inputs()[0]], p, use_tqdm=False),
                            lambda n: SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n),
                            wl.params[0]["max_tokens"], args.reps, llm.reset_prefix_cache)
    log(f"minivllm single-stream decode {single['decode_tok_per_s']:.1f} tok/s")
    floor = None
    if not args.skip_floor:
        from minivllm.bench.cpu_floor import linear_floor
        engine = llm.llm_engine
        floor = linear_floor(engine.executor.runner.model, [len(p) for p in wl.prompts], wl.params[0]["max_tokens"],
                             engine.config.scheduler.max_num_batched_tokens)
        log(f"linear layers alone over W5's schedule: {floor['floor_s']:.2f} s "
            f"(a ceiling of {floor['ceiling_tok_per_s']:.0f} tok/s); decode step ms {floor['decode_step_ms']}")
    return {"linear_floor": floor, "startup_s": startup, "output_tokens": n_out, "wall_s": wall, "batch_walls_s": walls,
            "output_tok_per_s": n_out / wall,
            "output_tokens_ok": n_out == wl.expected_output_tokens, "single_stream": single,
            # SmolLM2 ties its embedding to the lm_head: every parameter is read once per token
            "weight_bytes_per_token": param_bytes(llm.llm_engine.executor.runner.model)}, wl


def _single_stream(run, make_params, n: int, reps: int, reset=None) -> dict:
    p1, pn = make_params(1), make_params(n)
    run(pn)
    t1s, tns = [], []
    for params, dest in ((p1, t1s), (pn, tns)):
        for _ in range(reps):
            if reset is not None:
                reset()
            t = time.perf_counter()
            run(params)
            dest.append(time.perf_counter() - t)
    return dict(_decode_rate(t1s, tns, n), output_tokens=n, t1_s=t1s, tn_s=tns)


def _hf(wl: workloads.Workload, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from minivllm.models.source import default_gguf_path
    path = default_gguf_path()
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    load_s = time.perf_counter() - t
    n_new = wl.params[0]["max_tokens"]
    pad = model.generation_config.pad_token_id
    pad = pad if isinstance(pad, int) else 0
    width = max(len(p) for p in wl.prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in wl.prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in wl.prompts])

    def gen(input_ids, attention_mask, n):
        with torch.inference_mode():
            return model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=pad)

    gen(ids[:2], mask[:2], 4)  # warm-up
    walls = []
    for _ in range(args.batch_reps):
        t = time.perf_counter()
        out = gen(ids, mask, n_new)
        walls.append(time.perf_counter() - t)
        n_out = (out.shape[1] - width) * out.shape[0]
        log(f"HF W5 static batch: {n_out} tokens in {walls[-1]:.2f} s = {n_out / walls[-1]:.1f} tok/s")
    wall = statistics.median(walls)
    one = torch.tensor([wl.prompts[0]])
    single = _single_stream(lambda n: gen(one, torch.ones_like(one), n), lambda n: n, n_new, args.reps)
    log(f"HF single-stream decode {single['decode_tok_per_s']:.1f} tok/s")
    import transformers
    return {"load_s": load_s, "output_tokens": n_out, "wall_s": wall, "batch_walls_s": walls, "output_tok_per_s": n_out / wall,
            "padded_width": width, "single_stream": single, "version": transformers.__version__}


def _llama_cpp(wl: workloads.Workload, args) -> dict:
    from llama_cpp import Llama  # optional peer: pip install llama-cpp-python

    from minivllm.models.source import default_gguf_path
    llm = Llama(model_path=default_gguf_path(), n_ctx=2048, n_threads=os.cpu_count(), verbose=False)
    prompt = wl.prompts[0]
    n = wl.params[0]["max_tokens"]

    def run(k):
        llm.reset()
        llm.eval(prompt)
        for _ in range(k):
            tok = llm.sample(top_k=1)
            llm.eval([tok])

    single = _single_stream(run, lambda k: k, n, args.reps)
    log(f"llama.cpp single-stream decode {single['decode_tok_per_s']:.1f} tok/s")
    return {"single_stream": single}


def run_cpu_bench(args) -> int:
    import torch
    ours, wl = _minivllm(args)
    figures = {"minivllm_output_tok_per_s": ours["output_tok_per_s"], "minivllm_wall_s": ours["wall_s"],
               "minivllm_startup_s": ours["startup_s"], "output_tokens": ours["output_tokens"],
               "output_tokens_ok": ours["output_tokens_ok"],
               "minivllm_single_decode_tok_per_s": ours["single_stream"]["decode_tok_per_s"]}
    details = {"minivllm": ours, "torch_threads": torch.get_num_threads()}
    bw = read_bandwidth_gb_s()
    weight_bytes = ours.get("weight_bytes_per_token")
    figures["read_bandwidth_gb_s"] = bw
    if weight_bytes:
        # single-stream fp32 decode reads every weight once per token (lm_head included)
        figures["single_stream_ceiling_tok_per_s"] = bw * 1e9 / weight_bytes
        figures["single_stream_share_of_ceiling"] = (ours["single_stream"]["decode_tok_per_s"]
                                                     / figures["single_stream_ceiling_tok_per_s"])
    if ours["linear_floor"] is not None:
        floor = ours["linear_floor"]
        figures["linear_floor_s"] = floor["floor_s"]
        figures["linear_ceiling_tok_per_s"] = floor["ceiling_tok_per_s"]
        # plus decode attention's K/V reads at this run's read bandwidth: a floor for any engine
        # that uses these matrix-product libraries and reads the cache once per layer and step
        figures["kv_read_floor_s"] = floor["kv_read_bytes"] / (bw * 1e9)
        figures["engine_ceiling_tok_per_s"] = ours["output_tokens"] / (floor["floor_s"] + figures["kv_read_floor_s"])
    if not args.skip_hf:
        hf = _hf(wl, args)
        details["hf"] = hf
        figures.update(hf_output_tok_per_s=hf["output_tok_per_s"], hf_wall_s=hf["wall_s"],
                       hf_single_decode_tok_per_s=hf["single_stream"]["decode_tok_per_s"],
                       ratio_batch_minivllm_over_hf=ours["output_tok_per_s"] / hf["output_tok_per_s"],
                       ratio_single_minivllm_over_hf=ours["single_stream"]["decode_tok_per_s"]
                       / hf["single_stream"]["decode_tok_per_s"])
        if "linear_ceiling_tok_per_s" in figures:  # can the 3x target be reached on this machine at all?
            figures["three_x_hf_tok_per_s"] = 3 * hf["output_tok_per_s"]
            figures["linear_ceiling_over_hf"] = figures["linear_ceiling_tok_per_s"] / hf["output_tok_per_s"]
            figures["engine_ceiling_over_hf"] = figures["engine_ceiling_tok_per_s"] / hf["output_tok_per_s"]
    if not args.skip_llama_cpp:
        try:
            lc = _llama_cpp(wl, args)
            details["llama_cpp"] = lc
            figures["llama_cpp_single_decode_tok_per_s"] = lc["single_stream"]["decode_tok_per_s"]
            figures["ratio_single_minivllm_over_llama_cpp"] = (ours["single_stream"]["decode_tok_per_s"]
                                                               / lc["single_stream"]["decode_tok_per_s"])
        except ImportError as e:
            details["llama_cpp"] = f"not run: {e}"
    summary = wl.summary()
    summary.pop("conversations", None)
    emit(envelope("W5", "minivllm", _version(), "SmolLM2-135M-Instruct (bundled GGUF)", cpu_name(),
                  {"dtype": "float32", "device": "cpu", "reps": args.reps,
                                                  "batch_reps": args.batch_reps}, summary, figures, details), args.output)
    return 0 if figures["output_tokens_ok"] else 1


def read_bandwidth_gb_s(size_bytes: int = 1 << 30, reps: int = 5) -> float:
    """This machine's memory read bandwidth now, with torch's threads: the best of `reps` sums
    over a float32 buffer much larger than the caches."""
    import torch
    buf = torch.ones(size_bytes // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return size_bytes / best / 1e9


def _version() -> str:
    import minivllm
    return minivllm.__version__


def add_parser(sub) -> None:
    c = sub.add_parser("cpu", help="W5: CPU, real SmolLM2 fp32, minivllm vs HF generate in the same run")
    c.add_argument("--num-prompts", type=int, default=None, help="default: all 32")
    c.add_argument("--max-output", type=int, default=None, help="default: 128")
    c.add_argument("--reps", type=int, default=3, help="repetitions of each single-stream timing")
    c.add_argument("--batch-reps", type=int, default=3,
                   help="runs of the 32-prompt batch per engine; the figure is their median (this 2-core "
                        "VM loses part of its second core at times, so one run can be 10-30 %% slow)")
    c.add_argument("--skip-hf", action="store_true")
    c.add_argument("--skip-llama-cpp", action="store_true")
    c.add_argument("--skip-floor", action="store_true",
                   help="do not time the linear layers alone over W5's schedule (bench/cpu_floor.py)")
    c.add_argument("--output", default=None)
    add_observe_args(c)
    c.set_defaults(bench_func=run_cpu_bench)
