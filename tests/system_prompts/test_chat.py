"""chat.py: a system message's tokens from probe renders, and the reasons it would never match."""

import pytest

from vllm_relay.system_prompts.chat import chat_prompt_ids, first_difference, probe_conversations


def char_tokens(text):  # one token per character
    return [ord(c) for c in text]


def renders_of(template, system_text="S"):
    return {
        key: char_tokens(template(messages)) for key, messages in probe_conversations(system_text).items()
    }


def tagged(messages):  # system first, each turn closed by "|": a well-behaved template
    return "".join(f"<{m['role']}>{m['content']}|" for m in messages) + "<assistant>"


def test_well_behaved_template_gives_the_system_turn_and_the_user_header():
    ids = chat_prompt_ids("p", renders_of(tagged))
    assert ids == char_tokens("<system>S|<user>")
    for messages in probe_conversations("S").values():
        if messages[0]["role"] == "system":
            assert char_tokens(tagged(messages))[: len(ids)] == ids


def test_template_that_drops_the_system_message_is_refused():
    def drops(messages):
        return tagged([m for m in messages if m["role"] != "system"])

    with pytest.raises(
        ValueError, match=r"p: would never match .* renders the same 6 leading tokens without it"
    ):
        chat_prompt_ids("p", renders_of(drops))


def test_template_that_renders_the_system_message_after_the_user_turn_is_refused():
    def system_last(messages):
        return tagged(
            [m for m in messages if m["role"] != "system"] + [m for m in messages if m["role"] == "system"]
        )

    with pytest.raises(ValueError, match="without it"):
        chat_prompt_ids("p", renders_of(system_last))


def test_tokenizer_boundary_is_refused_with_the_position():
    # The system text runs straight into the user's text, and a "tokenizer" merges "S" with a
    # following "W" into one token: "What ..." then never starts with the probes' prefix.
    def glued(messages):
        return "".join(m["content"] for m in messages)

    renders = renders_of(glued)
    renders["question"] = [1000] + renders["question"][2:]  # "SW" -> one token
    with pytest.raises(
        ValueError,
        match=r"with another user message the rendered tokens differ from "
        r"the system part at token 0 of 1 \(a tokenizer boundary",
    ):
        chat_prompt_ids("p", renders)


def test_nothing_in_common_is_refused():
    with pytest.raises(ValueError, match="renders nothing common before the user message"):
        chat_prompt_ids("p", renders_of(lambda messages: messages[-1]["content"]))


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], [1]) == 0
