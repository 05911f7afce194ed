"""How long a grammar bitmask fill on a helper thread takes beside Python work on the calling
thread (the engine's detokenization), at Python's default GIL switch interval (5 ms) and at the
one LLMEngine._take_in sets while a fill runs (FILL_SWITCH_INTERVAL_S). xgrammar's fill releases
the GIL, but the helper thread needs it to start and to return: at 5 ms each handoff waits for
the interval while the caller runs Python.

    python3 scripts/bench_fill_overlap.py [--rows 256] [--python-ms 2.0]

Prints one line per interval: the fill alone, the Python work alone, both together (median of 20).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--python-ms", type=float, default=2.0)
    ap.add_argument("--advance", type=int, default=6, help="tokens each matcher takes before the timed fills")
    args = ap.parse_args()
    import xgrammar as xgr

    from transformers import AutoTokenizer

    from minivllm.bench import w7
    from minivllm.engine.llm_engine import FILL_SWITCH_INTERVAL_S
    tok = AutoTokenizer.from_pretrained(w7.write_model_dir(base="tiny-llama"))  # W7's: SmolLM2's vocabulary
    info = xgr.TokenizerInfo.from_huggingface(tok)
    compiler = xgr.GrammarCompiler(info)
    grammars = [compiler.compile_json_schema(json.dumps(schema)) for _, _, schema in w7.load_schemas()]
    matchers = [xgr.GrammarMatcher(grammars[i % len(grammars)]) for i in range(args.rows)]
    bitmask = xgr.allocate_token_bitmask(args.rows, info.vocab_size)
    for _ in range(args.advance):  # into the JSON (a fresh matcher's first mask is cheap): the last allowed token
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
            bits = np.unpackbits(bitmask[i].numpy().view(np.uint8), bitorder="little")[:info.vocab_size]
            m.accept_token(int(bits.nonzero()[0][-1]))
    batch = xgr.BatchGrammarMatcher(max_threads=max(1, (os.cpu_count() or 2) // 2))
    pool = ThreadPoolExecutor(1)

    def fill():
        live = list(matchers)  # a little Python first, as the manager's fill does
        batch.batch_fill_next_token_bitmask(live, bitmask)

    def python_work():
        t, s = time.perf_counter(), 0
        while time.perf_counter() - t < args.python_ms / 1e3:
            for i in range(200):
                s += i

    def timed(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    fill()
    alone, work = timed(fill), timed(python_work)
    for interval in (sys.getswitchinterval(), FILL_SWITCH_INTERVAL_S):
        previous = sys.getswitchinterval()
        sys.setswitchinterval(interval)
        runs = []
        for _ in range(20):
            t = time.perf_counter()
            future = pool.submit(fill)
            python_work()
            future.result()
            runs.append(time.perf_counter() - t)
        sys.setswitchinterval(previous)
        runs.sort()
        print(f"switch interval {interval * 1e3:.1f} ms: fill alone {alone * 1e3:.2f} ms, Python work "
              f"{work * 1e3:.2f} ms, both {runs[len(runs) // 2] * 1e3:.2f} ms ({args.rows} rows)")


if __name__ == "__main__":
    main()
