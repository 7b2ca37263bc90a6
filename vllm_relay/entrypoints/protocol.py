"""The relay endpoints' JSON: request parsing, response objects and OpenAI-style errors.

Pure (no vLLM), so the shapes are unit-tested on their own. Errors follow vLLM's and OpenAI's
body, `{"error": {"message", "type", "param", "code"}}`, with these statuses:

  400  malformed request: not JSON, unknown or missing field, wrong type, invalid name
  404  unknown system prompt, or relay not enabled on this server
  409  the name is taken (a draining registration does not count)
  413  longer than max_prompt_tokens, or leaves no room within max_model_len
  422  well-formed but unusable: empty, token ids outside the vocabulary, not one system message,
       or a chat prompt that would never match a chat request (the reason is given)
  500  the fill failed
  507  every slot of the system-prompt store is taken
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vllm_relay.config import check_prompt_name

FORMS = ("text", "token_ids", "messages")
FIELDS = ("name", *FORMS, "wait")
OBJECT = "relay.system_prompt"
# OpenAI SDK error class names by status (the SDK raises e.g. openai.ConflictError for 409).
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    507: "InsufficientStorageError",
}


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(frozen=True, slots=True)
class Registration:
    name: str
    form: str  # one of FORMS
    value: Any  # str | list[int] | list[dict], checked for type only
    wait: bool


def parse_registration(body: bytes) -> Registration:
    """`POST /v1/relay/system_prompts`: {"name", exactly one of FORMS, optional "wait"}."""
    try:
        request = json.loads(body)
    except ValueError as e:
        raise RequestError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(request, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(request).__name__}")
    if unknown := sorted(set(request) - set(FIELDS)):
        raise RequestError(400, f"unknown field(s) {unknown}; valid fields are {list(FIELDS)}", unknown[0])
    if "name" not in request:
        raise RequestError(400, "missing field 'name'", "name")
    try:
        name = check_prompt_name(request["name"])
    except ValueError as e:
        raise RequestError(400, str(e), "name") from None
    given = [f for f in FORMS if f in request]
    if len(given) != 1:
        raise RequestError(400, f"give exactly one of {list(FORMS)}, got {given or 'none'}")
    form, value = given[0], request[given[0]]
    expected = {"text": str, "token_ids": list, "messages": list}[form]
    if not isinstance(value, expected):
        raise RequestError(
            400,
            f"'{form}' must be a {'string' if expected is str else 'list'}, got {type(value).__name__}",
            form,
        )
    if form == "token_ids":
        bad = next((t for t in value if isinstance(t, bool) or not isinstance(t, int) or t < 0), None)
        if bad is not None:
            raise RequestError(400, f"token id {bad!r} is not a non-negative integer", form)
    if not value:
        raise RequestError(422, f"'{form}' is empty (a system prompt needs at least 1 token)", form)
    wait = request.get("wait", True)
    if not isinstance(wait, bool):
        raise RequestError(400, f"'wait' must be true or false, got {wait!r}", "wait")
    return Registration(name, form, value, wait)


def prompt_object(entry: dict) -> dict:
    """A listing entry of the engine core as the API returns it."""
    return {"object": OBJECT, **entry}


def list_object(entries: list[dict]) -> dict:
    return {"object": "list", "data": [prompt_object(e) for e in entries]}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }
