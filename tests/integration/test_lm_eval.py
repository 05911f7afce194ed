"""lm-evaluation-harness `local-completions` loglikelihood task end to end against the server:
lm-eval sends the tokenized context + continuation with echo, logprobs=1 and max_tokens=1, and
sums the continuation's prompt logprobs; each must equal the offline engine's prompt logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.async_engine import AsyncEngine
from minivllm.server.app import create_app
from minivllm.server.serving_common import ServerSettings
from minivllm.server.testing import ServerThread

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "tests" / "data" / "lm_eval_tiny"


@pytest.fixture(scope="module")
def llm_and_server():
    llm = LLM(dtype="float32", device="cpu", max_model_len=512)
    engine = AsyncEngine(llm.llm_engine)  # the engine thread; the offline oracle uses its own LLM below
    srv = ServerThread(create_app(engine, ServerSettings(own_engine=False))).start()
    try:
        yield srv.base_url, engine.config.model.served_name, llm.get_tokenizer()
    finally:
        srv.stop()
        engine.shutdown()


def test_lm_eval_local_completions(llm_and_server, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    base_url, model, tokenizer = llm_and_server
    tokenizer.save_pretrained(tmp_path / "tok")  # lm-eval tokenizes with a HF tokenizer directory
    monkeypatch.chdir(ROOT)  # the task's data_files path is relative to the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={model},base_url={base_url}/v1/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={tmp_path / 'tok'},num_concurrent=2,max_retries=1",
        tasks=["minivllm_tiny"], task_manager=TaskManager(include_path=str(TASK_DIR)), log_samples=True)
    docs = [json.loads(line) for line in (TASK_DIR / "docs.jsonl").read_text().splitlines()]
    samples = results["samples"]["minivllm_tiny"]
    assert len(samples) == len(docs)
    oracle = LLM(dtype="float32", device="cpu", max_model_len=512)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    correct = 0
    for s in samples:
        doc = s["doc"]
        lls = [r[0][0] for r in s["resps"]]
        want = []
        for choice in doc["choices"]:
            # as lm-eval does: the continuation is target_delimiter (" ") + the choice, encoded
            # apart from the context, then joined
            ctx = tokenizer.encode(doc["question"], add_special_tokens=False)
            full = ctx + tokenizer.encode(" " + choice, add_special_tokens=False)
            out = oracle.generate([{"prompt_token_ids": full}], params, use_tqdm=False)[0]
            want.append(sum(out.prompt_logprobs[p][full[p]].logprob for p in range(len(ctx), len(full))))
        assert lls == pytest.approx(want, abs=1e-3)
        correct += max(range(len(want)), key=want.__getitem__) == doc["answer"]
    assert results["results"]["minivllm_tiny"]["acc,none"] == pytest.approx(correct / len(docs))
