"""protocol.py: registration bodies, their errors (status, param) and the response shapes."""

import json

import pytest

from vllm_relay.entrypoints.protocol import RequestError, error_body, list_object, parse_registration


def parse(obj):
    return parse_registration(obj if isinstance(obj, bytes) else json.dumps(obj).encode())


def test_three_forms_and_wait():
    assert parse({"name": "a", "text": "Hi"}).form == "text"
    reg = parse({"name": "a.b-c_1", "token_ids": [1, 2], "wait": False})
    assert (reg.name, reg.form, reg.value, reg.wait) == ("a.b-c_1", "token_ids", [1, 2], False)
    assert parse({"name": "a", "messages": [{"role": "system", "content": "S"}]}).wait is True


@pytest.mark.parametrize(
    "body, status, param, message",
    [
        (b"{not json", 400, None, "the request body is not valid JSON"),
        ([1], 400, None, "must be a JSON object, got list"),
        (
            {"name": "a", "text": "x", "prompt": "y"},
            400,
            "prompt",
            "unknown field(s) ['prompt']; valid fields are",
        ),
        ({"text": "x"}, 400, "name", "missing field 'name'"),
        ({"name": "a b", "text": "x"}, 400, "name", "allowed characters are [A-Za-z0-9_.-]"),
        ({"name": "a" * 65, "text": "x"}, 400, "name", "65 characters, more than 64"),
        ({"name": "a"}, 400, None, "give exactly one of ['text', 'token_ids', 'messages'], got none"),
        ({"name": "a", "text": "x", "token_ids": [1]}, 400, None, "got ['text', 'token_ids']"),
        ({"name": "a", "text": 5}, 400, "text", "'text' must be a string, got int"),
        ({"name": "a", "messages": "S"}, 400, "messages", "'messages' must be a list, got str"),
        ({"name": "a", "token_ids": [1, -2]}, 400, "token_ids", "token id -2 is not a non-negative integer"),
        ({"name": "a", "token_ids": [1, True]}, 400, "token_ids", "token id True"),
        ({"name": "a", "text": "x", "wait": "yes"}, 400, "wait", "'wait' must be true or false"),
        ({"name": "a", "text": ""}, 422, "text", "'text' is empty"),
        ({"name": "a", "token_ids": []}, 422, "token_ids", "'token_ids' is empty"),
    ],
)
def test_errors(body, status, param, message):
    with pytest.raises(RequestError) as e:
        parse(body)
    assert (e.value.status, e.value.param) == (status, param) and message in e.value.message


def test_shapes_follow_openai():
    assert error_body(409, "taken") == {
        "error": {"message": "taken", "type": "ConflictError", "param": None, "code": 409}
    }
    assert error_body(507, "full", "name")["error"]["type"] == "InsufficientStorageError"
    assert list_object([{"name": "a"}]) == {
        "object": "list",
        "data": [{"object": "relay.system_prompt", "name": "a"}],
    }
