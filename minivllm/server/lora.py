"""The server's LoRA adapters: names clients put in the `model` field, each a LoRARequest.

Adapters come from `--lora-modules name=path ...` at startup and from
`POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` at run time (vLLM's endpoints). Every
adapter gets a fresh lora_int_id (never reused, so the prefix cache and the runner's slots can
never confuse an unloaded adapter with a later one), and is checked when it is registered
(lora/adapter.py: path, rank, base model), so a bad adapter is a 400 here, never a failed step.
"""

from __future__ import annotations

import itertools

from minivllm.lora.adapter import read_adapter
from minivllm.lora.request import LoRARequest
from minivllm.server.errors import OpenAIError, bad_request


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """`name=path` items (or vLLM's JSON form {"name": ..., "path": ...}) -> (name, path)."""
    import json
    out = []
    for v in values or []:
        if v.lstrip().startswith("{"):
            try:
                d = json.loads(v)
                out.append((str(d["name"]), str(d["path"])))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules: {v!r} is not {{\"name\": ..., \"path\": ...}}: {e}") from None
            continue
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules items must be name=path, got {v!r}")
        out.append((name, path))
    return out


class LoRARegistry:
    def __init__(self, engine_config, base_names: list[str]) -> None:
        self.config = engine_config
        self.base_names = base_names
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.config.lora is not None

    def add(self, name: str, path: str) -> LoRARequest:
        """Register an adapter; ValueError says why it cannot be served."""
        if not self.enabled:
            raise ValueError("LoRA adapters need a server started with --enable-lora")
        if not name:
            raise ValueError("lora_name must not be empty")
        if name in self.adapters or name in self.base_names:
            raise ValueError(f"the name {name!r} is already in use")
        read_adapter(path, self.config.model.arch, self.config.lora.max_lora_rank, name)
        lora = LoRARequest(name, next(self._ids), path)
        self.adapters[name] = lora
        return lora

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise OpenAIError(404, f"the LoRA adapter `{name}` is not loaded", "lora_name", "model_not_found")
        del self.adapters[name]

    def load_endpoint(self, name: str | None, path: str | None) -> str:
        """POST /v1/load_lora_adapter: 400 for a bad adapter or a taken name."""
        if not name or not path:
            raise bad_request("both lora_name and lora_path are required", "lora_name" if not name else "lora_path")
        try:
            self.add(name, path)
        except ValueError as e:
            raise bad_request(str(e), "lora_path") from None
        return f"Success: LoRA adapter '{name}' added successfully."
