"""A conversation and how it becomes the engine's prompt (chat completions, the Responses
API through them, and /tokenize's chat form): text-only messages rendered through the
model's chat template, with vLLM's template extras."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvscope.engine.server import tools
from kvscope.engine.server.errors import bad_request
from kvscope.engine.server.strict import Strict


class TextPart(Strict):
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """A content part of another type (image_url, input_audio, file, ...): parsed only to be
    refused by name in ``ChatPrompt.unsupported``."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class ChatPrompt(Strict):
    """A conversation and how it becomes a prompt: chat completions and /tokenize's chat
    form. vLLM's chat-template extras: end the prompt with the assistant's turn header
    (the default), or continue the final message as written (an assistant prefill)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: more variables for the template (e.g. Qwen3's {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> None:
        for i, m in enumerate(self.messages):
            for part in m.content if isinstance(m.content, list) else ():
                if isinstance(part, OtherPart):
                    raise bad_request(f"messages[{i}].content: parts of type '{part.type}' are "
                                      "not supported by kvscope (text only)", "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("'continue_final_message' needs 'add_generation_prompt': false "
                              "(the final message is continued, no new turn is opened)",
                              "continue_final_message")
        taken = set(self.chat_template_kwargs or ()) & _TEMPLATE_OWN
        if taken:
            raise bad_request(f"chat_template_kwargs may not set {sorted(taken)} (the "
                              "request's own fields say those)", "chat_template_kwargs")
        if self.continue_final_message and not self.messages[-1].text():
            raise bad_request("'continue_final_message' needs a final message with text",
                              "continue_final_message")

    def conversation(self) -> list[dict[str, Any]]:
        # "developer" is OpenAI's newer name for the system role.
        out = []
        for m in self.messages:
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                       "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(tools.template_message(message))
        return out

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools shown to the model through the chat template (None: no tools)."""
        return None

    def prompt_text(self, tokenizer: Any) -> str:
        """The conversation through the model's chat template, as the engine's prompt.
        With ``continue_final_message`` the text ends where the final message's content
        does (its end-of-turn markup cut off), as transformers and vLLM do it: a marker
        appended to the content is rendered and cut at, and when the template trims the
        content (the marker's trailing space is gone) the cut is trimmed too. Template
        errors raise ValueError."""
        conv = self.conversation()
        if self.continue_final_message:
            conv[-1]["content"] += _CONTINUE_MARK
        shown = self.template_tools()
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=self.add_generation_prompt,
                                             **(self.chat_template_kwargs or {}),
                                             **({"tools": shown} if shown else {}))
        if not self.continue_final_message:
            return text
        at = text.rfind(_CONTINUE_MARK.rstrip())
        if at < 0:
            raise ValueError("the chat template drops the final message's text, so it cannot "
                             "be continued")
        trimmed = not text.startswith(_CONTINUE_MARK, at)
        return text[:at].rstrip() if trimmed else text[:at]


# template variables the request's own fields set (chat_template_kwargs may not)
_TEMPLATE_OWN = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token",
                 "tokenize"}

# appended to a message to be continued, to find where its content ends once rendered
_CONTINUE_MARK = "KVSCOPE_CONTINUE_FINAL_MESSAGE "
