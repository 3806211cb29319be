"""A request body validated strictly, with one 400 shape for every problem: a body that is
not JSON, an unknown field (a typo such as ``max_token`` or ``temprature`` would change
the output if ignored), a missing one, a wrong JSON type (``"max_tokens": "5"``), or a
valid-typed value the server cannot honour (``Strict.unsupported``): each names the
field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from kvscope.engine.server.errors import APIError, bad_request


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    def unsupported(self) -> None:
        """Refuse valid-typed values the server cannot honour (a 400 naming the field)."""


# vLLM's removed guided-decoding fields: refused like any unknown field, saying where they went
_RENAMED = {f"guided_{k}": f"vLLM's old name; send \"structured_outputs\": {{\"{k}\": ...}}"
            for k in ("json", "regex", "choice", "grammar")}


def parse(model: type[Strict], body: bytes) -> Any:
    """Validate a JSON body; any problem becomes a 400 naming the offending field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise refusal(e) from None
    req.unsupported()
    return req


def refusal(e: ValidationError) -> APIError:
    """A validation error as the 400 that names its field."""
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return bad_request(f"malformed JSON body: {err['msg']}", code="invalid_json")
    loc = [str(p) for p in err["loc"] if isinstance(p, (str, int))]
    param = loc[0] if loc else None
    if err["type"] == "extra_forbidden":
        hint = _RENAMED.get(".".join(loc))
        return bad_request(f"unrecognized request argument '{'.'.join(loc)}'"
                           + (f" ({hint})" if hint else ""), param)
    if err["type"] == "missing":
        return bad_request(f"missing required argument '{'.'.join(loc)}'", param)
    return bad_request(f"invalid '{param}': {err['msg']}"
                       + (f" (at {'.'.join(loc)})" if len(loc) > 1 else ""), param)
