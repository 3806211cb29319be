"""The daemon's OpenAPI document, with the request models of the endpoints in it.

The handlers read and validate the raw body themselves (``protocol.parse``: one 400 shape
for every problem), so FastAPI cannot see their request models; this adds them to the
document (``components.schemas``) and points each route's requestBody at its model, so
that clients and fuzzers (schemathesis) know the real bodies.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is ``model``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF.format(model=model.__name__)}}}}}


def install(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` include ``models`` (and the models they use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template=REF)
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
