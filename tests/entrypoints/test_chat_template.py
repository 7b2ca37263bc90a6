"""A server started with --chat-template: chat prompts, given at start-up or over HTTP, are rendered
with that template (not the model's), so chat requests rendered with it match them; a request
that brings another template is counted as a mismatch and explained once in the log."""

import pytest

from tests.entrypoints.server import API_KEY, PROMPTS, SERVED_NAME, Server, wait_for
from vllm_relay.system_prompts.chat import common_prefix

pytestmark = pytest.mark.engine

# Plain-text headers, nothing like the model's own template (tests/testing: special-token turns).
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}### {{ m['role'] | capitalize }}:\n{{ m['content'] }}\n\n"
    "{% endfor %}{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)
GREETER = ("You greet customers of the shipping company in one short sentence, by name where you know it, and "
           "you never promise a delivery date that the tracking page does not show.")
SUPPORT = ("You answer questions about parcels, briefly: where a parcel is, when it should arrive, and what to "
           "do when it is late, lost or damaged on the way.")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vllm_relay.testing.models import get_model
    from vllm_relay.testing.server import RelayServer

    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    relay = {
        "max_prompts": 3,
        "max_prompt_tokens": 512,
        "log_stats_interval_s": 0,
        "metrics_interval_s": 0.2,
        "system_prompts": {"greeter": {"chat_system": GREETER}},
    }
    args = [
        "--max-model-len",
        "1024",
        "--block-size",
        "32",
        "--chat-template",
        str(template),
        "--trust-request-chat-template",
    ]
    with RelayServer(get_model("tiny-llama-gqa"), SERVED_NAME, relay=relay, args=args, api_key=API_KEY) as s:
        yield Server(s.url, API_KEY, SERVED_NAME, s.log_text)


def rendered(system, template=TEMPLATE):
    """The token prefix two chats with `system` share under `template`, computed here."""
    from transformers import AutoTokenizer

    from vllm_relay.testing.models import get_model

    tok = AutoTokenizer.from_pretrained(get_model("tiny-llama-gqa"))
    renders = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": u}],
                chat_template=template,
                tokenize=False,
                add_generation_prompt=True,
            ),
            add_special_tokens=False,
        )
        for u in ("Hello.", "42?")
    ]
    return common_prefix(*renders)


def test_startup_chat_prompt_is_rendered_with_the_server_template(server):
    greeter = server.prompt("greeter")
    # The engine filled it with the model's template first; the server filled it again with its own.
    assert greeter["state"] == "ready" and greeter["generation"] == 2 and greeter["source"] == "config"
    assert greeter["tokens"] == len(rendered(GREETER)) != len(rendered(GREETER, template=None))
    assert "system prompt 'greeter' rendered with this server's chat template" in server.log()
    server.chat(GREETER, "Hello!")
    wait_for(
        lambda: server.prompt("greeter")["requests_served"] == 1, what="the greeter chat served by relay"
    )


def test_http_chat_prompt_matches_chats_rendered_with_the_server_template(server):
    status, created = server.call(
        "POST", PROMPTS, {"name": "support", "messages": [{"role": "system", "content": SUPPORT}]}
    )
    assert status == 201 and created["tokens"] == len(rendered(SUPPORT)), created
    before = server.steady_metric("vllm_relay_requests_total")  # the greeter chat included
    reply = server.chat(SUPPORT, "Where is my parcel?")
    assert reply["usage"]["prompt_tokens"] > created["tokens"]
    wait_for(lambda: server.relay_metric("vllm_relay_requests_total") == before + 1, what="relay to fire")
    assert (
        server.prompt("support")["requests_served"] == 1 and server.prompt("support")["chat_mismatches"] == 0
    )


def test_request_with_another_template_is_a_reported_mismatch(server):
    from transformers import AutoTokenizer

    from vllm_relay.testing.models import get_model

    model_template = AutoTokenizer.from_pretrained(get_model("tiny-llama-gqa")).chat_template
    before = server.prompt("greeter")
    for _ in range(2):
        server.chat(GREETER, "Hello!", chat_template=model_template)
    after = wait_for(
        lambda: (p := server.prompt("greeter"))["chat_mismatches"] == 2 and p, what="2 mismatches"
    )
    assert after["requests_served"] == before["requests_served"]  # both ran the ordinary way
    wait_for(
        lambda: server.relay_metric("vllm_relay_chat_mismatches_total") == 2, what="the metric to count them"
    )
    warnings = [
        line for line in server.log().splitlines() if "carries the system message of prompt 'greeter'" in line
    ]
    assert len(warnings) == 1 and "first difference at token 1" in warnings[0]
    assert "likely another chat template" in warnings[0]
