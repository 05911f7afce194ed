"""Keep Python's oldest-generation garbage collections short in a long-running engine.

After startup the heap holds hundreds of thousands of container objects that live as long as the
process: modules and functions of torch/transformers, the model's modules, one KVBlock per KV
block (47,000 for Qwen3-8B on an H200). A full (generation-2) collection walks all of them; on the
H200 machine that took ~200 ms, and one ran every ~12 engine steps under W3 load, stalling the
GPU for a quarter of the run. `gc.freeze()` moves everything alive at that point into a permanent
generation that collections skip, so later full collections only walk objects made since
(requests, outputs). The cost: a frozen object that later becomes cyclic garbage is never freed
while frozen. An engine's own objects are such garbage once it is dropped (the runner and its
CUDA-graph runner refer to each other): its shutdown, or the LLM being deleted, unfreezes the heap
(`unfreeze_heap`), or a second engine in the process would find the first one's GPU memory still
allocated (lease 8: a quantization test's second engine planned no KV block).
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

logger = logging.getLogger(__name__)
_unfreeze_registered = False


def freeze_startup_heap() -> None:
    """Collect what startup left behind, then freeze the surviving heap (process-wide). At exit
    the heap is unfrozen again, so the interpreter's final collection still frees it (extension
    modules such as Triton's report frozen objects as leaks otherwise)."""
    global _unfreeze_registered
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True
    logger.debug("froze %d startup objects in %.0f ms", gc.get_freeze_count(), (time.perf_counter() - t) * 1e3)


def unfreeze_heap() -> None:
    """Undo freeze_startup_heap (process-wide): a dropped engine's cycles become collectable.
    A later engine's startup freezes again."""
    if gc is not None:  # (None late in interpreter shutdown)
        gc.unfreeze()
