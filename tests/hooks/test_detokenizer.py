"""hooks/detokenizer.py: a relay front end's detokenizer primed with the prompt's last tokens gives
exactly vLLM's text (its own FastIncrementalDetokenizer, primed with the whole prompt, is the
reference), on random prompts and outputs of two locally built tokenizers: the test models' byte-level
BPE and a SentencePiece-style BPE (byte fallback, a leading-space strip), with byte tokens that split
characters, tails of special tokens and prompts ending inside a character."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers

import vllm_relay
from vllm_relay.hooks import detokenizer as hook
from vllm_relay.testing.models import get_model
from vllm_relay.testing.tokenizer import training_text

SPECIAL = ["<unk>", "<s>", "</s>"]


def sentencepiece_style():
    """Llama-2's tokenizer.json layout: '▁' for spaces, byte fallback, fuse, strip one leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=1200, show_progress=False,
                                  special_tokens=SPECIAL + [f"<0x{b:02X}>" for b in range(256)])
    tok.train_from_iterator(training_text(0, 1500) + ["héllo wörld ✓ 😀 日本語のテキスト"], trainer)
    return tok


def backends():
    from transformers import AutoTokenizer, TokenizersBackend

    byte_level = AutoTokenizer.from_pretrained(get_model("tiny-llama-mha"))
    sp = TokenizersBackend(tokenizer_object=sentencepiece_style(), bos_token="<s>", eos_token="</s>",
                           unk_token="<unk>")
    return {"byte-level BPE": byte_level, "sentencepiece-style": sp}


def random_ids(rng, tok, n):
    """Ids of any kind: ordinary, special, and (one in three) byte tokens of multi-byte characters."""
    inner = tok._tokenizer
    bytes_ = [i for i in (inner.token_to_id(f"<0x{b:02X}>") for b in range(0x80, 0x100)) if i is not None]
    if not bytes_:  # byte-level BPE: its single-byte tokens are the first 256 after the specials
        bytes_ = list(range(len(SPECIAL) + 1, len(SPECIAL) + 257))
    V = inner.get_vocab_size()
    return [rng.choice(bytes_) if rng.random() < 0.33 else rng.randrange(V) for _ in range(n)]


def request(rng, tok, prompt):
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    params = SamplingParams(skip_special_tokens=rng.random() < 0.7,
                            spaces_between_special_tokens=rng.random() < 0.5)
    return EngineCoreRequest(request_id="r", prompt_token_ids=prompt, mm_features=None,
                             sampling_params=params, pooling_params=None, arrival_time=0.0, lora_request=None,
                             cache_salt=None, data_parallel_rank=None)


def texts(tok, req, outputs):
    """Every delta and the final text of vLLM's detokenizer for `req`, fed `outputs` in chunks."""
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer, IncrementalDetokenizer

    detok = IncrementalDetokenizer.from_new_request(tok, req)
    assert isinstance(detok, FastIncrementalDetokenizer)
    deltas = []
    for chunk in outputs:
        detok.update(chunk, False)
        deltas.append(detok.get_next_output_text(False, True))
    return deltas, detok.output_text


@pytest.fixture
def primed(monkeypatch):
    vllm_relay.register()
    monkeypatch.setattr(hook, "_enabled", True)
    return monkeypatch


@pytest.mark.parametrize("name", ["byte-level BPE", "sentencepiece-style"])
def test_primed_with_the_tail_the_text_is_vllms(name, primed):
    tok = backends()[name]
    rng = random.Random(0)
    tails = 0
    for _ in range(300):
        prompt = random_ids(rng, tok, rng.randrange(1, 400))
        if rng.random() < 0.15:  # a tail of special tokens, skipped or not when decoding
            prompt += [rng.randrange(len(SPECIAL))] * rng.randrange(1, 200)
        outputs = [random_ids(rng, tok, rng.randrange(1, 4)) for _ in range(rng.randrange(1, 12))]
        req = request(rng, tok, prompt)
        primed.setattr(hook, "PRIME_TOKENS", 0)  # vLLM's own priming: the reference
        want = texts(tok, req, outputs)
        primed.setattr(hook, "PRIME_TOKENS", rng.choice([8, 32, 128]))
        assert texts(tok, req, outputs) == want, (prompt, outputs)
        skip = req.sampling_params.skip_special_tokens
        tails += len(prompt) > 128 and hook.tail_for(tok._tokenizer, prompt, skip, 128) is not prompt
    assert tails > 50  # most long prompts were primed with their tail, not all of them


def test_the_tail_is_dropped_where_its_text_is_empty_or_ends_inside_a_character():
    inner = backends()["byte-level BPE"]._tokenizer
    words = inner.encode(" the quick brown fox jumps over the lazy dog" * 8, add_special_tokens=False).ids
    assert hook.tail_for(inner, words, True, 0) is words
    assert hook.tail_for(inner, words[:5], True, 8) == words[:5]
    assert hook.tail_for(inner, words, True, 16) == words[-16:]
    specials = words + [2] * 20  # </s> x 20: no text once skipped
    assert hook.tail_for(inner, specials, True, 16) is specials
    assert hook.tail_for(inner, specials, False, 16) == specials[-16:]  # kept: "</s>" is text
    cut = words + inner.encode("😀", add_special_tokens=False).ids[:1]  # the first byte of a 4-byte character
    assert inner.decode(cut[-16:]).endswith("\ufffd") and hook.tail_for(inner, cut, True, 16) is cut


def test_only_a_relay_front_end_primes_with_the_tail(monkeypatch):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    vllm_relay.register()
    monkeypatch.setattr(hook, "_enabled", False)
    tok = backends()["byte-level BPE"]
    prompt = random_ids(random.Random(1), tok, 1000)
    req = request(random.Random(1), tok, prompt)
    primed_ids = []
    monkeypatch.setattr(hook, "tail_for", lambda *a: primed_ids.append(a[1]) or a[1])
    FastIncrementalDetokenizer(tok, req)
    assert primed_ids == []  # no relay engine in this process yet: vLLM's own priming, untouched
    model = get_model("tiny-llama-gqa")
    EngineArgs(model=model, max_model_len=512).create_engine_config()
    assert not hook._enabled
    relay = EngineArgs(model=model, max_model_len=512, block_size=16, attention_backend="relay")
    relay.create_engine_config()
    assert hook._enabled
    FastIncrementalDetokenizer(tok, req)
    assert primed_ids == [prompt]
