"""Front-end hook: the incremental detokenizer primed with the prompt's last tokens, not all of them.

vLLM's `FastIncrementalDetokenizer` (0.26 to 0.33, the same body) primes tokenizers' `DecodeStream` with the whole prompt, and
the stream's first step decodes it all (twice) to find where the new text starts: O(prompt) per
request, in the front end's process, when the first token arrives. n samples of one long prompt are
n requests, each paying it: at 16,000 tokens 7.7 ms a request on this project's CPU machine and 6.2 ms
on the H100 host's (bench_detokenizer.py, in git history), 2.0 and 1.6 s for n=256; end to end on that
H100, +4.8% at n=256 (most of the front end's time overlaps the engine core's;
benchmarks/results/archive/2026-11-27_cpu_detokenizer/).
vLLM's `SlowIncrementalDetokenizer` has always primed with a few prompt tokens only; the open
vllm-project/vllm#51281 and #57330 make the fast one do the same (32 and 128 tokens).

A new token's text depends on the prompt only through the last few tokens (a byte-fallback or byte-
level character spans at most 4 bytes; a decoder's leading-space strip applies to the stream's first
token, a prompt token either way), so the stream gets the prompt's last `PRIME_TOKENS`. Where the
text of that tail is empty (special tokens only) or ends in an incomplete character, the stream gets
the whole prompt, as vLLM gives it (vLLM's first delta then holds the prompt's text,
vllm-project/vllm#48853; this hook changes no output, also not that one). Tested against vLLM's own
detokenizer on random prompts and outputs of a byte-level BPE and a SentencePiece-style tokenizer.

Active in a process once it builds a relay engine's config (`hooks/frontend.py` calls `enable`).
"""

from vllm_relay.hooks._patch import original, patch

# Prompt tokens a relay front end's incremental detokenizer is primed with (vllm-project/vllm#57330's
# bound; #51281 uses 32), measured against vLLM's whole-prompt priming in
# benchmarks/results/archive/2026-11-27_cpu_detokenizer/. 0 primes it with the whole prompt, as vLLM
# does (the reference in tests/hooks/test_detokenizer.py).
PRIME_TOKENS = 128

_Fast = None
_enabled = False


def enable() -> None:
    """Prime this process's fast detokenizers with the prompt's tail from now on (a relay engine's
    front end)."""
    global _enabled
    _enabled = True


def tail_for(tokenizer, prompt: list[int], skip_special_tokens: bool, keep: int) -> list[int]:
    """The prompt ids to prime a `DecodeStream` with: the last `keep` (keep > 0), or all of them
    when their text is empty or ends in an incomplete character (see the module docstring)."""
    if keep <= 0 or len(prompt) <= keep:
        return prompt
    tail = prompt[-keep:]
    text = tokenizer.decode(tail, skip_special_tokens=skip_special_tokens)
    return tail if text and not text.endswith("\ufffd") else prompt


def _init(self, tokenizer, request):
    prompt = request.prompt_token_ids
    if _enabled and prompt is not None:  # vLLM's __init__ then primes with the tail (a copy of the request)
        skip = request.sampling_params.skip_special_tokens
        ids = tail_for(tokenizer._tokenizer, prompt, skip, PRIME_TOKENS)
        if ids is not prompt:
            import msgspec

            request = msgspec.structs.replace(request, prompt_token_ids=ids)
    original(_Fast, "__init__")(self, tokenizer, request)


def apply() -> None:
    global _Fast
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    _Fast = FastIncrementalDetokenizer
    patch(FastIncrementalDetokenizer, "__init__", _init)
