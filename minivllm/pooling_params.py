"""PoolingParams: how an embedding request pools the model's hidden states (mirrors vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.sampling_params import RequestOutputKind

POOLING_TYPES = ("LAST", "MEAN")


@dataclass
class PoolerConfig:
    """The engine's defaults (vLLM's `pooler_config`): LAST = the last prompt token's final hidden
    state (what a decoder model's causal attention has seen all of the text at), MEAN = the mean
    over every prompt token; normalize = scale to unit L2 norm."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        self.pooling_type = str(self.pooling_type).upper()
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {list(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")

    @classmethod
    def parse(cls, value: PoolerConfig | dict | str | None) -> PoolerConfig:
        """A PoolerConfig, a dict of its fields or their JSON (the --pooler-config flag)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"pooler_config must be JSON, got {value!r}: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a dict or JSON object, got {type(value).__name__}")
        unknown = set(value) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler_config has unknown fields {sorted(unknown)} (known: pooling_type, normalize)")
        return cls(**value)


@dataclass
class PoolingParams:
    """Per request: normalize (None: the engine's pooler_config), pooling_type (None: likewise),
    dimensions (only the model's full hidden size: no model here is trained for truncation)."""

    normalize: bool | None = None
    dimensions: int | None = None
    pooling_type: str | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.pooling_type is not None:
            self.pooling_type = str(self.pooling_type).upper()
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(f"PoolingParams.pooling_type must be one of {list(POOLING_TYPES)}, "
                                 f"got {self.pooling_type!r}")
        if self.dimensions is not None and not (isinstance(self.dimensions, int) and self.dimensions >= 1):
            raise ValueError(f"PoolingParams.dimensions must be an integer >= 1, got {self.dimensions!r}")

    @property
    def n(self) -> int:
        return 1

    def resolved(self, config: PoolerConfig, hidden_size: int) -> PoolingParams:
        """A copy with the engine's defaults filled in; ValueError for dimensions it cannot give."""
        if self.dimensions is not None and self.dimensions != hidden_size:
            raise ValueError(f"PoolingParams.dimensions={self.dimensions} is not supported: this model's "
                             f"embeddings have {hidden_size} dimensions and it is not trained for shorter ones "
                             f"(leave dimensions out, or set it to {hidden_size})")
        return PoolingParams(config.normalize if self.normalize is None else self.normalize, None,
                             self.pooling_type or config.pooling_type, self.output_kind)

    def clone(self) -> PoolingParams:
        return PoolingParams(**self.__dict__)
