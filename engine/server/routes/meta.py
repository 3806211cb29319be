"""What the server says about itself: GET /health, /metrics (Prometheus) and
/v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvscope.engine.server.admission import authorize, check_model, server_state
from kvscope.engine.server.state import ServerState

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = server_state(request)
    engine = state.engine
    if engine.failed is not None or not engine.alive:
        return JSONResponse({"status": "failed", "error": str(engine.failed)}, 500)
    if state.draining:
        return JSONResponse({"status": "draining"}, 503)
    return JSONResponse({"status": "ok", "in_flight": engine.num_inflight})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    state = server_state(request)
    authorize(state, request)
    return JSONResponse({"object": "list", "data": [_model(state)]})


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> JSONResponse:
    """One model (the openai client's ``models.retrieve``): the served one, else 404."""
    state = server_state(request)
    authorize(state, request)
    check_model(state, model_id)
    return JSONResponse(_model(state))


def _model(state: ServerState) -> dict:
    return {"id": state.settings.served_model_name, "object": "model",
            "created": state.created, "owned_by": "kvscope",
            "max_model_len": state.max_model_len}
