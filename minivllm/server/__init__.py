"""The OpenAI-compatible HTTP server (`minivllm serve`): protocol models, FastAPI app, serving, metrics, CLI,
and the W3 serving benchmark client (bench_serve)."""
