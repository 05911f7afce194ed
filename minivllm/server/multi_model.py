"""Several models behind one server (issue 24): `minivllm serve --model A --model B`, or
`--models-config models.yaml` naming the models and their memory shares:

    models:
      - model: /path/to/a.gguf        # any engine option may follow (max_model_len, ...)
        served_model_name: small
        memory_share: 0.25            # of the KV memory (default: an equal part of what is left)
      - model: /path/to/b
        served_model_name: big
        memory_share: 0.75

Each model gets its own engine (core) and its own KV pool sized from its share (engine option
`memory_share`: on a GPU a share of gpu_memory_utilization, on the CPU of the KV budget), and its
own app (server/app.py: its routes, limits and metrics labelled with its model_name). `ModelRouter`,
an ASGI app in front, picks the app by the request body's `model` field (no field: the first
model; a name no model serves: 404 with an OpenAI error body), lists every model on /v1/models,
merges the apps' /metrics and reports /health for all engines.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from starlette.types import Receive, Scope, Send

from minivllm.config import check
from minivllm.server.errors import JSONResponse, OpenAIError, error_response

_PER_MODEL_GET = ("/load", "/dashboard")  # per-model views, by ?model=


@dataclass(frozen=True)
class ModelSpec:
    kwargs: dict  # engine keyword arguments of this model (model, served_model_name, memory_share, ...)

    @property
    def name(self) -> str | None:
        return self.kwargs.get("served_model_name")


def model_specs(models: list[str], config_path: str | None, base: dict,
                names: list[str] | None = None) -> list[ModelSpec]:
    """The served models: `--model` given several times (equal shares; `names` one served name
    each) or a YAML file; each spec's kwargs are the command line's engine options overridden by
    the model's own."""
    entries = [{"model": m} for m in models]
    if names:
        check(len(names) == len(models) and config_path is None, "--served-model-name",
              f"must give one name per --model ({len(models)}), got {names}; or name them in --models-config")
        entries = [dict(e, served_model_name=n) for e, n in zip(entries, names)]
    if config_path is not None:
        check(not models, "--models-config", "cannot be combined with several --model flags")
        entries = _read_models_config(config_path)
    given = [e.get("memory_share") for e in entries]
    for s in given:
        check(s is None or (isinstance(s, (int, float)) and 0 < s <= 1), "memory_share",
              f"must be in (0, 1], got {s!r}")
    total = sum(s for s in given if s is not None)
    check(total <= 1.0 + 1e-9, "memory_share", f"of all models must add up to at most 100 %, got {100 * total:.0f} %")
    rest = [i for i, s in enumerate(given) if s is None]
    check(not rest or total < 1.0, "memory_share", "leaves nothing for the models without one")
    for i in rest:
        entries[i] = dict(entries[i], memory_share=(1.0 - total) / len(rest))
    specs = [ModelSpec(dict(base, **e)) for e in entries]
    names = [s.name or str(s.kwargs.get("model")) for s in specs]
    check(len(set(names)) == len(names), "served_model_name",
          f"must differ between models (served twice: {sorted({n for n in names if names.count(n) > 1})})")
    return specs


def _read_models_config(path: str) -> list[dict]:
    import yaml
    with open(path) as f:
        doc = yaml.safe_load(f)
    models = doc.get("models") if isinstance(doc, dict) else None
    check(isinstance(models, list) and models and all(isinstance(m, dict) and "model" in m for m in models),
          "--models-config", f"{path!r} must hold `models:`, a list of entries each with a `model` key")
    return models


class ModelRouter:
    """ASGI app routing each request to the app of the model it names."""

    def __init__(self, apps: list) -> None:
        """apps: FastAPI apps from server/app.py's create_app, one per model (the first: the default)."""
        self.apps = apps
        self.by_name = {name: app for app in apps for name in app.state.minivllm.base.model_names}
        for app in apps:  # each model's dashboard links to the others'
            app.state.minivllm.all_model_names = list(self.by_name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] != "http":
            await self.apps[0](scope, receive, send)
        elif scope["path"] == "/v1/models" and scope["method"] == "GET":
            await JSONResponse(self._model_list())(scope, receive, send)
        elif scope["path"] == "/metrics":
            await self._metrics(scope, receive, send)
        elif scope["path"] == "/health":
            await self._health(scope, receive, send)
        elif scope["method"] == "POST":
            await self._route_by_body(scope, receive, send)
        elif scope["path"].startswith(_PER_MODEL_GET):
            await self._route_by_query(scope, receive, send)
        else:
            await self.apps[0](scope, receive, send)

    async def _route_by_query(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET /load, /dashboard, /dashboard/events: `?model=NAME` picks the model (default: the first)."""
        from urllib.parse import parse_qs
        name = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model", [None])[0]
        app = self.apps[0] if name is None else self.by_name.get(name)
        if app is None:
            err = OpenAIError(404, f"The model `{name}` does not exist. This server serves: {', '.join(self.by_name)}.",
                              "model", "model_not_found")
            await error_response(err)(scope, receive, send)
            return
        await app(scope, receive, send)

    async def _route_by_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Reads the body (the apps' own limit applies: past it, the default app answers 413),
        finds its `model`, and replays the body to that model's app."""
        limit = self.apps[0].state.minivllm.settings.max_body_bytes
        chunks, size, more = [], 0, True
        while more and size <= limit:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
        body = b"".join(chunks)
        app = self.apps[0]
        if not more:
            name = _model_field(body)
            if name is not None:
                app = self.by_name.get(name)
                if app is None:
                    err = OpenAIError(404, f"The model `{name}` does not exist. This server serves: "
                                      f"{', '.join(self.by_name)}.", "model", "model_not_found")
                    await error_response(err)(scope, receive, send)
                    return
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": more}
            return await receive()

        await app(scope, replay, send)

    def _model_list(self) -> dict:
        from minivllm.server.protocol import ModelCard, ModelList
        cards = []
        for app in self.apps:
            s = app.state.minivllm
            cards += [ModelCard(id=n, root=s.engine.config.model.source_path, max_model_len=s.engine.max_model_len)
                      for n in s.base.model_names]
        return ModelList(data=cards).model_dump()

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST
        from starlette.responses import Response
        body = merge_metrics([app.state.minivllm.metrics.render() for app in self.apps])
        await Response(body, media_type=CONTENT_TYPE_LATEST)(scope, receive, send)

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        from starlette.responses import Response

        from minivllm.engine.async_engine import EngineDeadError
        for app in self.apps:
            try:
                app.state.minivllm.engine.check_health()
            except EngineDeadError as e:
                await error_response(OpenAIError(503, str(e), code="engine_dead"))(scope, receive, send)
                return
        await Response(status_code=200)(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """The apps' own lifespans do not run behind the router: their status logs (one per
        model, each line naming it) and their shutdown happen here."""
        from minivllm.server.status_log import start_status_log
        status_logs = []
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                for app in self.apps:
                    state = app.state.minivllm
                    status_logs.append(start_status_log(state, state.base.model_name))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for task in status_logs:
                    if task is not None:
                        task.cancel()
                for app in self.apps:
                    state = app.state.minivllm
                    state.metrics.close()
                    if state.settings.own_engine:
                        await asyncio.to_thread(state.engine.shutdown, state.settings.shutdown_grace_s)
                await send({"type": "lifespan.shutdown.complete"})
                return


def _model_field(body: bytes) -> str | None:
    """The body's `model` if it is a JSON object naming one (anything else: the default app
    answers, with its own 400 for a bad body)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    name = doc.get("model") if isinstance(doc, dict) else None
    return name if isinstance(name, str) else None


def merge_metrics(texts: list[bytes]) -> bytes:
    """One exposition of several registries' metric families (the same family from several models
    becomes one family whose samples carry each model_name)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    families: dict = {}
    for text in texts:
        for fam in text_string_to_metric_families(text.decode()):
            if fam.name in families:
                families[fam.name].samples += fam.samples
            else:
                families[fam.name] = fam

    class _Parsed:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry()
    registry.register(_Parsed())
    return generate_latest(registry)
