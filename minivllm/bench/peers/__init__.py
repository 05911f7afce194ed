"""Peer runners: the same workloads on vLLM and on Hugging Face transformers, each run as its own
process (never in one process or on one GPU at the same time as minivllm)."""
