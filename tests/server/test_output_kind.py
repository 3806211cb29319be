"""A response that is not streamed asks the engine for each request's last output only
(RequestOutputKind.FINAL_ONLY); a streamed one for every step's (CUMULATIVE), which its
deltas are cut from."""

from __future__ import annotations

import json

import pytest

from kvscope.engine.sampling_params import RequestOutputKind
from kvscope.engine.server.limits import Limits
from kvscope.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from kvscope.engine.server.strict import parse


@pytest.mark.parametrize("stream, kind", [(False, RequestOutputKind.FINAL_ONLY),
                                          (True, RequestOutputKind.CUMULATIVE)])
def test_output_kind_follows_stream(stream, kind):
    completion = parse(CompletionRequest, json.dumps(
        {"model": "m", "prompt": "hi", "stream": stream}).encode())
    chat = parse(ChatCompletionRequest, json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}],
         "stream": stream}).encode())
    for req in (completion, chat):
        assert req.to_sampling_params(8, Limits(2048, 49152)).output_kind is kind
