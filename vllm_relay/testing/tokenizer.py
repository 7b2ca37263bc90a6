"""A small byte-level BPE tokenizer, trained locally for test models.

No tokenizer can be downloaded in our environments, so the test models ship
one trained here: byte-level BPE (any text encodes, nothing maps to <unk>),
about 3k tokens, trained in well under a second on text generated from
``corpus.txt`` with a fixed seed. The output is byte-for-byte reproducible for
a given seed and ``tokenizers`` version (``tests/testing`` checks it).

The chat template renders every system message first, and each message ends
with the special token ``<|end|>``. Special tokens split the text before BPE
runs, so the tokens of the system part never depend on what follows: two chats
with the same system message share a token prefix that covers the whole
system part, up to and including its ``<|end|>``. This is the prefix that
RelayAttention shares between requests.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
# Llama's order for the first three, so bos=1 and eos=2 as in Llama-2 configs.
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
VOCAB_SIZE = 3072

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages if message['role'] == 'system' %}"
    "<|system|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# A typical system message, used by tests and benchmarks to size prompts.
SYSTEM_MESSAGE = (
    "You are a helpful, honest and careful assistant. Answer the user's "
    "questions clearly and concisely. If you do not know the answer, say so "
    "instead of guessing. Think step by step before you reply, and keep your "
    "answers short unless the user asks for more detail."
)
# Its length without <s>; the chat template adds 5 (<s>, <|system|>, "\n", <|end|>, "\n").
SYSTEM_MESSAGE_TOKENS = 73

_CORPUS = Path(__file__).with_name("corpus.txt")


def _read_corpus() -> tuple[str, list[str]]:
    lines = [ln for ln in _CORPUS.read_text(encoding="utf-8").splitlines() if not ln.startswith("#")]
    cut = lines.index("== words ==")
    prose = "\n".join(lines[:cut])
    words = " ".join(lines[cut + 1 :]).split()
    return prose, words


def training_text(seed: int = 0, sentences: int = 6000) -> list[str]:
    """Deterministic English-like training lines: the prose plus sampled paragraphs.

    Words are drawn with Zipf-like weights so frequent words get merged into
    single tokens first, as in a real tokenizer; capitals, numbers and
    punctuation appear so that they get merges too.
    """
    prose, words = _read_corpus()
    rng = random.Random(seed)
    cum, total = [], 0.0
    for rank in range(len(words)):
        total += 1.0 / (rank + 8)
        cum.append(total)
    lines = prose.splitlines() * 8
    paragraph: list[str] = []
    for _ in range(sentences):
        n = rng.randint(4, 18)
        ws = rng.choices(words, cum_weights=cum, k=n)
        ws[0] = ws[0].capitalize()
        if rng.random() < 0.15:
            ws.insert(rng.randrange(1, n), str(rng.choice([rng.randint(0, 99), rng.randint(100, 99999)])))
        if n > 8 and rng.random() < 0.4:
            ws[rng.randrange(2, n - 2)] += ","
        paragraph.append(" ".join(ws) + rng.choice(".....?!:"))
        if len(paragraph) >= rng.randint(1, 6):
            lines.append(" ".join(paragraph))
            paragraph = []
    return lines + [" ".join(paragraph)] if paragraph else lines


def train(seed: int = 0, vocab_size: int = VOCAB_SIZE):
    """Train and return a ``tokenizers.Tokenizer`` (not yet wrapped for transformers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS + CHAT_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(seed), trainer=trainer)
    # Plain encodes get <s> in front, like Llama; the chat template writes its own
    # bos_token and callers render it with add_special_tokens=False.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def fill_vocab(tok, vocab_size: int):
    """Extend ``tok``'s BPE vocab with filler words up to ``vocab_size`` ids.

    A real tokenizer covers its model's whole vocab, so every token a model samples decodes to
    text. A model of a real shape (32000 or 128256 ids) with the 3k-token test tokenizer would
    sample ids the tokenizer cannot decode; vLLM's incremental detokenizer then never advances
    and re-decodes the whole prompt at every step, a front-end cost that grows with the prompt
    and no real deployment pays. The fillers (`` w<base-26 number>``) have no merges, so they
    never appear in an encoding: texts encode exactly as before.
    """
    import json

    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    next_id = max(max(vocab.values()), *(t["id"] for t in spec["added_tokens"])) + 1
    i = 0
    while next_id < vocab_size:
        word, n = "", i
        while True:
            word, n = chr(ord("a") + n % 26) + word, n // 26
            if not n:
                break
        i += 1
        token = "\u0120w" + word  # "\u0120" is the byte-level form of a leading space
        if token not in vocab:
            vocab[token] = next_id
            next_id += 1
    return Tokenizer.from_str(json.dumps(spec))


def build_tokenizer(path: str | Path, seed: int = 0, model_max_length: int = 4096,
                    vocab_size: int | None = None) -> Path:
    """Write a Hugging Face fast-tokenizer folder to ``path`` and return it.

    The folder holds tokenizer.json, tokenizer_config.json (special tokens and
    the chat template) and special_tokens_map.json; it loads with
    ``transformers.AutoTokenizer.from_pretrained``, which is what vLLM uses.
    ``vocab_size``: pad the vocab with filler words up to that many ids (`fill_vocab`).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train(seed)
    if vocab_size is not None and vocab_size > tok.get_vocab_size():
        tok = fill_vocab(tok, vocab_size)
    tok.save(str(path / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    config = {
        # The generic class loads tokenizer.json as saved; LlamaTokenizer would
        # rebuild a SentencePiece-style pipeline around our vocab.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "additional_special_tokens": CHAT_TOKENS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(path / "tokenizer_config.json", config)
    _write_json(path / "special_tokens_map.json", {**special, "additional_special_tokens": CHAT_TOKENS})
    return path


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
