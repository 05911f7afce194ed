"""The benchmark suite's data and plumbing: the standard workloads exactly as BENCHMARKS.md
defines them, the bundled model configs, the driver's job selection and table, and a CPU smoke
run of `minivllm bench throughput` on a tiny dummy model."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from minivllm.bench import compare, model_dirs, workloads
from minivllm.bench.common import last_json_line, workload_list

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_CONFIGS = os.path.join(os.path.dirname(REPO), "shared", "model-configs")


# ---- W1 ---------------------------------------------------------------------------------------------
def test_w1_total_output_tokens_is_133966():
    wl = workloads.w1()
    assert wl.num_requests == 256
    assert sum(p["max_tokens"] for p in wl.params) == 133_966
    assert wl.expected_output_tokens == 133_966


def test_w1_lengths_ids_and_params_within_bounds():
    wl = workloads.w1()
    assert all(100 <= len(p) <= 1024 for p in wl.prompts)
    assert all(0 <= t <= 10000 for p in wl.prompts for t in p)
    for p in wl.params:
        assert 100 <= p["max_tokens"] <= 1024
        assert p["temperature"] == 0.6 and p["ignore_eos"] is True
    assert wl.max_model_len == 4096
    assert wl.model_config == "qwen3-0.6b" and workloads.get("W1-8B").model_config == "qwen3-8b"


def test_w1_matches_bench_py_draw_order_with_global_random():
    """nano-vllm's bench.py: random.seed(0), all prompts first, then all max_tokens."""
    state = random.getstate()
    try:
        random.seed(0)
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
        max_tokens = [random.randint(100, 1024) for _ in range(256)]
    finally:
        random.setstate(state)
    wl = workloads.w1()
    assert wl.prompts == prompts
    assert [p["max_tokens"] for p in wl.params] == max_tokens


def test_workloads_are_deterministic_and_leave_global_random_alone():
    state = random.getstate()
    assert workloads.w1().prompts == workloads.w1().prompts
    assert workloads.w4().prompts == workloads.w4().prompts
    assert workloads.w2().prompts == workloads.w2().prompts
    assert random.getstate() == state


# ---- W2, W4, W5 -------------------------------------------------------------------------------------------
def test_w2_is_one_128_token_prompt_256_greedy_tokens():
    wl = workloads.w2()
    assert wl.num_requests == 1 and len(wl.prompts[0]) == 128
    assert wl.params == [{"temperature": 0.0, "ignore_eos": True, "max_tokens": 256}]
    assert wl.model_config == "llama-3.1-8b"
    assert workloads.first_token_params(wl.params[0])["max_tokens"] == 1


def test_w4_shared_prefix_structure():
    wl = workloads.w4()
    assert wl.num_requests == 256 and wl.model_config == "qwen3-8b"
    prefix = wl.prompts[0][:2000]
    assert all(len(p) == 2064 and p[:2000] == prefix for p in wl.prompts)
    suffixes = {tuple(p[2000:]) for p in wl.prompts}
    assert len(suffixes) == 256  # unique
    assert all(p == {"temperature": 0.0, "ignore_eos": True, "max_tokens": 128} for p in wl.params)
    assert wl.expected_output_tokens == 256 * 128


def test_w5_prompts_fit_their_target_lengths():
    def encode(conv):  # a stand-in tokenizer: ~1 token per word + a fixed template overhead
        return list(range(12 + sum(len(m["content"].split()) for m in conv)))

    wl = workloads.w5(encode)
    assert wl.num_requests == 32
    lens = [len(p) for p in wl.prompts]
    assert all(20 <= n <= 200 for n in lens)
    assert max(lens) - min(lens) > 100  # mixed lengths
    assert all(p["max_tokens"] == 128 and p["ignore_eos"] for p in wl.params)


# ---- scaling for smoke runs ------------------------------------------------------------------------------
def test_scaled_takes_the_first_requests_and_clamps():
    wl = workloads.w1().scaled(num_requests=4, max_output=8, max_prompt=64)
    full = workloads.w1()
    assert wl.num_requests == 4
    assert wl.prompts == [p[:64] for p in full.prompts[:4]]
    assert wl.expected_output_tokens == 32
    assert workloads.w1().scaled().expected_output_tokens == 133_966
    with pytest.raises(ValueError):
        workloads.w1().scaled(num_requests=0)


def test_fit_vocab_only_when_needed():
    wl = workloads.w1().scaled(num_requests=2)
    assert wl.fit_vocab(151936) is wl
    small = wl.fit_vocab(1000)
    assert all(t < 1000 for p in small.prompts for t in p)
    assert small.meta["token_ids_mod_vocab"] == 1000


def test_workload_list_argument():
    parse = workload_list(["W1", "W1-8B", "W4"])
    assert parse("W4,W1-8B") == ["W4", "W1-8B"]
    with pytest.raises(Exception):
        parse("W2")


# ---- bundled model configs -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b", "qwen3-32b", "llama-3.1-8b", "qwen3-30b-a3b"])
def test_bundled_configs_equal_the_shared_ones(name):
    shared = os.path.join(SHARED_CONFIGS, name, "config.json")
    if not os.path.isfile(shared):
        pytest.skip("../shared/model-configs is not beside this checkout")
    with open(shared) as f:
        assert model_dirs.load_config(name) == json.load(f)


def test_write_model_dir_and_param_counts(tmp_path):
    d = model_dirs.write_model_dir("qwen3-0.6b", str(tmp_path / "m"))
    with open(os.path.join(d, "config.json")) as f:
        assert json.load(f)["hidden_size"] == 1024
    totals = {n: model_dirs.param_counts(model_dirs.load_config(n))["total"] / 1e9
              for n in ("qwen3-0.6b", "qwen3-8b", "llama-3.1-8b")}
    assert totals["qwen3-0.6b"] == pytest.approx(0.596, abs=0.002)
    assert totals["qwen3-8b"] == pytest.approx(8.19, abs=0.01)
    assert totals["llama-3.1-8b"] == pytest.approx(8.03, abs=0.01)
    roof = model_dirs.decode_roofline(model_dirs.load_config("llama-3.1-8b"), 128, 256, 3.02e12)
    assert roof["roofline_ms_all_weights"] == pytest.approx(5.32, abs=0.03)  # BENCHMARKS.md's figure
    assert roof["roofline_ms"] < roof["roofline_ms_all_weights"]
    with pytest.raises(ValueError):
        model_dirs.config_path("no-such-model")


def test_w10_workloads_and_active_weight_roofline():
    """W10: W1's requests and W2's request on Qwen3-30B-A3B; its batch-1 roofline counts the
    weights a token reads (BENCHMARKS.md: ~6.1 GB, ~2.0 ms on an H100), not all 30.5 B."""
    w10, dec = workloads.get("W10"), workloads.get("W10-decode")
    assert w10.prompts == workloads.w1().prompts and w10.expected_output_tokens == 133_966
    assert dec.prompts == workloads.w2().prompts and dec.params == workloads.w2().params
    assert w10.model_config == dec.model_config == "qwen3-30b-a3b"
    cfg = model_dirs.load_config("qwen3-30b-a3b")
    counts = model_dirs.param_counts(cfg)
    assert counts["total"] / 1e9 == pytest.approx(30.53, abs=0.01)
    # per layer: attention 18.87 M + q/k norms + 2 norms, router 128 x 2048, 8 experts x 3 x 2048 x 768
    per_layer = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128 + 2 * 2048 + 128 * 2048 + 8 * 3 * 2048 * 768
    assert counts["layers_active"] == 48 * per_layer
    wb = model_dirs.weight_bytes(cfg)
    assert wb["read_per_decode_step"] == 2 * (48 * per_layer + 2048 + 151936 * 2048)
    roof = model_dirs.decode_roofline(cfg, 128, 256, 3.02e12)
    assert roof["roofline_ms"] == pytest.approx(2.02, abs=0.01)
    dense = model_dirs.load_config("qwen3-8b")  # dense models read every layer weight
    assert model_dirs.param_counts(dense)["layers_active"] == model_dirs.param_counts(dense)["layers"]


# ---- the driver -----------------------------------------------------------------------------------------
def test_driver_selection_and_table():
    assert [j.name for j in compare.select("ours:W1,vllm:W1")] == ["ours:W1", "vllm:W1"]
    assert {j.name for j in compare.select("*:W4-nopc")} == {"ours:W4-nopc", "vllm:W4-nopc"}
    with pytest.raises(SystemExit):
        compare.select("nope:*")
    job = compare.JOBS["ours:W4+W1-8B"]
    recs = compare.split_record(job, {"job": job.name, "rc": 0, "result": [
        {"workload": "W4", "device": "GPU", "figures": {"output_tok_per_s": 100.0}},
        {"workload": "W1-8B", "device": "GPU", "figures": {"output_tok_per_s": 50.0}}]})
    results = {r["job"]: r for r in recs}
    assert set(results) == {"ours:W4", "ours:W1-8B"}
    results["vllm:W4"] = {"job": "vllm:W4", "result": {"device": "GPU", "figures": {"output_tok_per_s": 200.0}}}
    text = compare.table(results)
    line = next(li for li in text.splitlines() if li.startswith("W4 output tok/s, prefix caching on"))
    assert line.split()[-5:] == ["100", "200", "0.5", "-", "-"]  # minivllm, vLLM, ours/vLLM, HF, ours/HF


def test_vllm_runner_imports_and_dry_runs_without_vllm():
    r = subprocess.run([sys.executable, "-m", "minivllm.bench.peers.vllm_runner", "throughput", "--workload",
                        "W4,W1-8B", "--dry-run"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(li) for li in r.stdout.splitlines() if li.startswith("{")]
    assert [x["workload"] for x in lines] == ["W4", "W1-8B"]
    assert lines[1]["workload_summary"]["expected_output_tokens"] == 133_966
    assert lines[0]["settings"]["load_format"] == "dummy" and lines[0]["settings"]["skip_tokenizer_init"]


# ---- CPU smoke run of the real command --------------------------------------------------------------------
def test_bench_throughput_cpu_smoke():
    cmd = [sys.executable, "-m", "minivllm", "bench", "throughput", "--workload", "W1", "--model-config", "tiny-llama",
           "--device", "cpu", "--num-requests", "4", "--max-output", "8", "--max-prompt", "64",
           "--kv-cache-memory-bytes", "8000000"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = last_json_line(r.stdout)
    assert res["workload"] == "W1" and res["engine"] == "minivllm" and res["model_config"] == "tiny-llama"
    f = res["figures"]
    assert f["output_tokens"] == 32 and f["output_tokens_ok"] is True
    assert f["output_tok_per_s"] > 0 and f["wall_s"] > 0 and f["startup_s"] > 0
    assert f["launch_to_first_token_s"] is None or f["launch_to_first_token_s"] > 0
    assert res["details"]["runs"][0]["per_request_lengths_ok"] is True
    assert res["date"] and res["device"] and "bench throughput" in res["command"]


def test_bundled_tokenizer_makes_every_model_id_decodable(tmp_path):
    """Beam jobs and W7 give the dummy model the default model's tokenizer: the config's vocab
    then equals the tokenizer's, so every id an engine can sample decodes (vLLM's beam_search
    detokenizes every beam)."""
    import json

    from transformers import AutoTokenizer

    from minivllm.bench import model_dirs
    d = model_dirs.write_model_dir("qwen3-0.6b", str(tmp_path / "m"))
    assert not model_dirs.has_tokenizer(d)
    vocab = model_dirs.add_bundled_tokenizer(d)
    cfg = json.load(open(f"{d}/config.json"))
    tok = AutoTokenizer.from_pretrained(d)
    assert model_dirs.has_tokenizer(d) and cfg["vocab_size"] == vocab == len(tok)
    assert cfg["hidden_size"] == model_dirs.load_config("qwen3-0.6b")["hidden_size"]  # shapes otherwise unchanged
    assert tok.decode([vocab - 1]) and tok.convert_ids_to_tokens(cfg["eos_token_id"]) == "<|im_end|>"
