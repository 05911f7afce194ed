"""POST /v1/embeddings (OpenAI's shape): one pooled, normalized vector per input."""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import Request
from starlette.responses import Response

from minivllm.pooling_params import PoolingParams
from minivllm.server.errors import JSONResponse, OpenAIError, bad_request, from_value_error
from minivllm.server.protocol import EmbeddingRequest
from minivllm.server.serving_common import ServingBase, collect_or_abort, new_id, usage


def embedding_prompts(inp) -> list:
    """input: a string, strings, token ids or lists of token ids -> engine prompts."""
    if isinstance(inp, str):
        return [inp]
    if not inp:
        raise bad_request("input must not be empty", "input")
    if all(isinstance(x, int) for x in inp):
        return [{"prompt_token_ids": list(inp)}]
    return [x if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in inp]


class ServingEmbedding(ServingBase):
    async def create(self, req: EmbeddingRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        try:
            params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
        except ValueError as e:
            raise from_value_error(e, "dimensions") from None
        prompts = embedding_prompts(req.input)
        rid = new_id("embd")
        streams = await self.submit(rid, prompts, params, req.priority, "input", None, self.lora_for(req.model))
        finals = await collect_or_abort(raw, streams)
        if finals is None:
            return Response(status_code=499)
        if any(not out.outputs.embedding for out in finals):  # ended by an engine failure, not input
            raise OpenAIError(500, "the engine failed while computing this embedding")
        data = [{"object": "embedding", "index": i, "embedding": _encode(out.outputs.embedding, req.encoding_format)}
                for i, out in enumerate(finals)]
        n_prompt = sum(len(out.prompt_token_ids) for out in finals)
        return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": model,
                             "data": data, "usage": usage(n_prompt, 0)})


def _encode(vec: list[float], fmt: str) -> list[float] | str:
    """base64: the float32 little-endian bytes, as OpenAI's client decodes them."""
    if fmt == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec
