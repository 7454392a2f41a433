"""A small byte-level BPE tokenizer, GLM-style, for tiny models trained on the built-in synthetic tasks.

Design:
- Ids 0..255 are the 256 bytes (GPT-2 ByteLevel alphabet, id == byte value), so any text round-trips.
- Then `NUM_MERGES` BPE merges, trained by a deterministic pure-Python loop on `_CORPUS` (ties broken by
  the lexicographically smallest pair), so every build writes the same `tokenizer.json` bytes.
- Digits are split one per pre-token before ByteLevel, so each ASCII digit is exactly one token.
- Then the GLM added tokens (`SPECIAL_TOKENS`). `<think>`, `</think>`, `<tool_call>`, `</tool_call>` are
  single ids but not "special": `decode(..., skip_special_tokens=True)` keeps them, as reward parsers need.

Chat template (GLM-4/5 layout): `[gMASK]<sop>` then `<|role|>\\n{content}` per message; the generation prompt
is `<|assistant|>\\n`. Tool calls and results follow GLM-4.5's template (its chat_template.jinja): a call is
`<tool_call>{name}\\n<arg_key>{k}</arg_key>\\n<arg_value>{v}</arg_value>\\n</tool_call>` (string values as they are,
others as JSON), and a run of tool results is `<|observation|>` then `\\n<tool_response>\\n{output}\\n</tool_response>`
per result. Convention: an assistant turn that calls tools ends where the `<|observation|>` of their results begins
(the model stops on it, as GLM's generation config says); every other assistant turn ends with `<|endoftext|>`, which
is `eos_token` (and `pad_token`). GLM's empty `<think></think>` prefix and the newline before `<tool_call>` are left
out: a tiny model learns less boilerplate.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
CONTROL_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
TAG_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
# GLM-4.5's tool-call markup (its tokenizer has each as one added token); appended last so earlier ids stay put.
TOOL_TAG_TOKENS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>")
SPECIAL_TOKENS = (EOS_TOKEN, *CONTROL_TOKENS, *TAG_TOKENS, *TOOL_TAG_TOKENS)
NOT_SPECIAL = (*TAG_TOKENS, *TOOL_TAG_TOKENS)  # single ids that decode(skip_special_tokens=True) keeps

NUM_BYTES = 256
NUM_MERGES = 117
VOCAB_SIZE = NUM_BYTES + NUM_MERGES + len(SPECIAL_TOKENS)  # 390: ids the tokenizer can produce
MODEL_VOCAB_SIZE = -(-VOCAB_SIZE // 64) * 64  # embedding rows for a model config: VOCAB_SIZE rounded up to 64

# No whitespace control ("{%-"): the template is one line, and newlines are written only where they belong.
CHAT_TEMPLATE = (
    "{% macro text(content) %}"
    "{% if content is string %}{{ content }}"
    "{% elif content is not none %}{% for part in content if part.type == 'text' %}{{ part.text }}{% endfor %}"
    "{% endif %}"
    "{% endmacro %}"
    "[gMASK]<sop>"
    "{% if tools %}<|system|>\n# Tools{% for tool in tools %}{{ '\\n' ~ (tool | tojson) }}{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}<|system|>\n{{ text(message.content) }}"
    "{% elif message.role == 'user' %}<|user|>\n{{ text(message.content) }}"
    "{% elif message.role == 'assistant' %}<|assistant|>\n"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ text(message.content) }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set call = call.function if call.function is defined else call %}"
    "<tool_call>{{ call.name }}\n"
    "{% for key, value in call.arguments.items() %}"
    "<arg_key>{{ key }}</arg_key>\n<arg_value>{{ value if value is string else value | tojson }}</arg_value>\n"
    "{% endfor %}"
    "</tool_call>"
    "{% endfor %}"
    "{% if not message.tool_calls %}<|endoftext|>{% endif %}"
    "{% elif message.role in ('tool', 'observation') %}"
    "{% if loop.first or loop.previtem.role not in ('tool', 'observation') %}<|observation|>{% endif %}"
    "{{ '\\n<tool_response>\\n' ~ text(message.content) ~ '\\n</tool_response>' }}"
    "{% else %}{{ raise_exception('unknown chat role ' ~ message.role ~ '; expected system, user, assistant or tool') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Training text for the merges: the phrasing of the built-in tasks (arithmetic, countdown, tool use).
_CORPUS = (
    "Compute 12 + 34 * 5 - 6 / 3. Put the final answer in <answer></answer>.",
    "Compute the value of (7 + 8) * 9 - 10. Answer with a number.",
    "What is 123 + 456? Answer: 579",
    "What is 98 - 76? The answer is 22.",
    "Using the numbers [3, 5, 7, 2], create an equation that equals 24. "
    "You can use basic arithmetic operations (+, -, *, /) and each number can only be used once.",
    "Use the numbers 4, 6, 8, 1 to make 24. Each number must be used exactly once. "
    "Show your work in <think> </think> tags and return the final equation in <answer> </answer> tags.",
    "Use the numbers 10, 2, 3 to make 15. Answer: <answer>(10 + 2) + 3</answer>",
    "Let me think step by step. First, 3 * 5 = 15. Then 15 + 7 = 22. So the answer is 22.",
    "Let me think. We need to make the target number with the given numbers.",
    "The result of the expression is the final answer. Check the result and then answer.",
    "<answer>42</answer> <answer>(4 + 6) * 2</answer> <answer>8 / 4</answer>",
    "Call the calculator tool with the expression to compute the result.",
    '{"name": "calculator", "arguments": {"expression": "3 + 4 * 5"}}',
    '{"name": "calculator", "arguments": {"expression": "(12 - 4) / 2"}}',
    "The tool returned the result 23. The answer is 23.",
    "You are a helpful assistant. Solve the problem and give the answer.",
    "Question: what is the sum of the numbers? Answer the question with the number only.",
    "Solve the equation for the value and write the answer in the answer tags.",
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of the ByteLevel pre-tokenizer."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = {}, 0
    for b in range(NUM_BYTES):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(NUM_BYTES + extra)
            extra += 1
    return chars


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )


def _train_merges(corpus: tuple[str, ...], num_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE on the pre-tokenized corpus; most frequent pair first, ties to the smallest pair."""
    pre = _pre_tokenizer()
    word_counts = Counter(piece for text in corpus for piece, _ in pre.pre_tokenize_str(text))
    words = {tuple(word): count for word, count in word_counts.items()}
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pair_counts: Counter[tuple[str, str]] = Counter()
        for symbols, count in words.items():
            for pair in zip(symbols, symbols[1:]):
                pair_counts[pair] += count
        best = min(pair_counts, key=lambda pair: (-pair_counts[pair], pair), default=None)
        if best is None or pair_counts[best] < 2:
            raise RuntimeError(f"tokenizer corpus yields only {len(merges)} merges; NUM_MERGES is {num_merges}")
        merges.append(best)
        words = {_apply_merge(symbols, best): count for symbols, count in words.items()}
    return merges


def _apply_merge(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def _build_backend() -> Tokenizer:
    """The `tokenizers` object: byte vocab + trained merges + added GLM tokens."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    merges = _train_merges(_CORPUS, NUM_MERGES)
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens(
        [AddedToken(t, special=t not in NOT_SPECIAL, normalized=False) for t in SPECIAL_TOKENS]
    )
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, (tokenizer.get_vocab_size(), VOCAB_SIZE)
    return tokenizer


def _tokenizer_config() -> dict:
    """Keys of tokenizer_config.json, spelled so that transformers 4.x (SGLang) and 5.x both load them."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "additional_special_tokens": list(CONTROL_TOKENS),
        "clean_up_tokenization_spaces": False,  # True would turn " ." into "." and break the round trip
        "model_max_length": 1 << 20,
        "padding_side": "left",  # generation pads prompts on the left
        "chat_template": CHAT_TEMPLATE,
    }


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the tokenizer in memory (deterministic, no files, no network)."""
    config = {k: v for k, v in _tokenizer_config().items() if k != "tokenizer_class"}
    return PreTrainedTokenizerFast(tokenizer_object=_build_backend(), **config)


def save_tokenizer(directory: str | Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(_build_backend().to_str(pretty=True) + "\n", encoding="utf-8")
    config = _tokenizer_config()
    special = {k: config[k] for k in ("eos_token", "pad_token", "additional_special_tokens")}
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        (directory / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return directory
