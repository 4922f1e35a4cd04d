"""Chat messages -> prompt token ids: the chat template (the tokenizer's, or the
router's --chat-template), rendered by transformers' `apply_chat_template`, then
tokenized without adding special tokens a second time (the template wrote them).

    system, developer (as system), user, assistant, tool; content a string or a list of
    {"type": "text", "text": ...} parts (joined); anything else is a 400 naming the
    message's field. Assistant turns' tool_calls and tool turns' tool_call_id go to the
    template as tools/messages.py writes them; a request's tools as `tools=`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.engine.tokenizer import Tokenizer
from pdserve.services.router.http.errors import bad_request, invalid
from pdserve.services.router.http.protocol import Message
from pdserve.services.router.http.tools.messages import tool_fields
from pdserve.services.router.validate import check_prompt_bytes

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# apply_chat_template's own parameters: not the template's variables a client may set.
RESERVED_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})


def conversation(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The messages as the template takes them. Raises ApiError naming the field."""
    out = []
    for i, message in enumerate(messages):
        role = ROLES.get(message.role)
        if role is None:
            raise bad_request(f"messages.{i}.role", f"must be one of {sorted(ROLES)}, got {message.role!r}")
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages.{i}.content.{j}", f"only text parts are supported, got {part.type!r}")
                texts.append(part.text)
            content = "".join(texts)
        out.append({"role": role, "content": content or "",
                    **tool_fields(i, role, message.tool_calls, message.tool_call_id)})
    return out


def chat_prompt(
    tokenizer: Tokenizer | None, template: str | None, messages: Sequence[Message], add_generation_prompt: bool,
    continue_final_message: bool, kwargs: Mapping[str, Any] | None, add_special_tokens: bool,
    max_prompt_bytes: int | None = None, tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt of a chat request (`tools`: the template's `tools=`, OpenAI's shape).
    Raises ApiError (400) or ValueError naming the field.
    The rendered text is refused past `max_prompt_bytes` before it is tokenized (as a
    text prompt is: tokenizing megabytes costs the router seconds)."""
    if tokenizer is None:
        raise bad_request("messages", "this model has no tokenizer: use /v1/completions with token ids")
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message", "cannot go with add_generation_prompt: true")
    if continue_final_message and messages[-1].role != "assistant":
        raise bad_request("continue_final_message", "needs an assistant message last")
    for key in kwargs or {}:
        if key in RESERVED_KWARGS:
            raise bad_request("chat_template_kwargs", f"{key!r} is set by the request itself")
    if tools:
        kwargs = {**(kwargs or {}), "tools": tools}
    text = tokenizer.render_chat(conversation(messages), template, add_generation_prompt, continue_final_message,
                                 kwargs)
    if max_prompt_bytes is not None:
        try:
            check_prompt_bytes(text, max_prompt_bytes, "messages")
        except ValueError as e:
            raise invalid(e) from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
