"""``InferenceSession.get_modelmeta()``: the object ONNX Runtime returns, with its attributes."""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx


@dataclass(frozen=True)
class ModelMetadata:
    producer_name: str = ""
    graph_name: str = ""
    domain: str = ""
    description: str = ""
    graph_description: str = ""
    version: int = 0
    custom_metadata_map: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> ModelMetadata:
        return cls(
            producer_name=model.producer_name, graph_name=model.graph.name, domain=model.domain,
            description=model.doc_string, graph_description=model.graph.doc_string,
            version=int(model.model_version),
            custom_metadata_map={p.key: p.value for p in model.metadata_props},
        )
