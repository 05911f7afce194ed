"""Write W8's prompt set (minivllm/bench/data/w8_prompts.json): input-grounded chat prompts for
speculative decoding, 16 passages of 200-800 tokens x 4 tasks (summarise, edit, quote, translate).

The passages are docstrings of the Python standard library (real English prose, free to ship),
picked once and kept in the repo: rerunning this on another Python version may pick others.

    python scripts/make_w8_prompts.py
"""

from __future__ import annotations

import importlib
import inspect
import json
import os

MODULES = ["argparse", "textwrap", "difflib", "heapq", "itertools", "csv", "sqlite3", "logging", "sched", "copy",
           "unittest", "doctest", "timeit", "inspect", "http.client", "urllib.request", "pickle", "tokenize",
           "typing", "zipfile", "shutil", "random", "tempfile", "json"]
TASKS = {
    "summarise": "Summarise the following passage in a few sentences, reusing its own words where you can.",
    "edit": "Rewrite the following passage with every sentence kept, fixing any awkward wording.",
    "quote": "Quote the most important sentences of the following passage exactly, one per line.",
    "translate": "Translate the following passage into plain English for a beginner, sentence by sentence.",
}
NUM_PASSAGES = 16


def passages(tokenizer) -> list[tuple[str, str]]:
    seen, out = set(), []
    for mod in MODULES:
        m = importlib.import_module(mod)
        for name, obj in [(mod, m)] + [(f"{mod}.{n}", getattr(m, n)) for n in sorted(dir(m)) if not n.startswith("_")]:
            if not (inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            doc = inspect.getdoc(obj)
            if not doc or ">>>" in doc or doc in seen or getattr(obj, "__name__", mod).split(".")[0] != name.split(".")[-1]:
                continue
            if 200 <= len(tokenizer(doc).input_ids) <= 800:
                seen.add(doc)
                out.append((name, doc))
                break
        if len(out) == NUM_PASSAGES:
            break
    return out


def main() -> int:
    from minivllm.engine.config_builder import build_engine_config
    from minivllm.engine.tokenizer import load_tokenizer
    tok = load_tokenizer(build_engine_config(None).model)
    chosen = passages(tok)
    assert len(chosen) == NUM_PASSAGES, f"only {len(chosen)} passages found"
    prompts = [{"source": name, "task": task, "prompt": f"{instruction}\n\n{doc}"}
               for name, doc in chosen for task, instruction in TASKS.items()]
    path = os.path.join(os.path.dirname(__file__), "..", "minivllm", "bench", "data", "w8_prompts.json")
    with open(path, "w") as f:
        json.dump(prompts, f, indent=1)
    print(f"{len(prompts)} prompts from {[n for n, _ in chosen]} -> {os.path.normpath(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
