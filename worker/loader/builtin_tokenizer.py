"""The built-in models' tokenizer: byte-level BPE trained offline on a generated corpus.

The corpus is sentences drawn with a fixed seed from a small embedded vocabulary (prose,
numbers, code-like lines, chat turns), so training needs no download and gives the same
`tokenizer.json` every time. The chat template is ChatML (`<|im_start|>role ... <|im_end|>`)
with system, user, assistant (incl. tool calls) and tool messages; newlines right after a
block tag are written as `{{ '\\n' }}` because HF renders with `trim_blocks`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, END_OF_TEXT = "<|begin_of_text|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [END_OF_TEXT, BOS, "<|im_start|>", EOS]

_WORDS = """
the a an one two three some every this that these those my your our their its
cat dog bird fish horse mouse lion tiger bear wolf fox rabbit owl eagle snake frog
river mountain forest city village ocean desert island valley garden road bridge house
tower castle market school library station harbor field cloud storm rain snow wind sun
moon star light shadow fire water stone tree flower leaf seed root branch apple bread
runs walks jumps sleeps sings reads writes builds finds keeps gives takes makes sees
hears knows thinks wants needs likes loves opens closes starts stops moves turns holds
quickly slowly quietly loudly often never always sometimes early late soon again here
big small old new red blue green yellow bright dark warm cold happy sad clever brave
and but or so because while after before when if then than with without under over
into onto from to of in on at by for about between through across near far
server worker router cache token prefix request session memory cluster model queue
batch prefill decode latency throughput kernel tensor layer block page slot evict
""".split()

_CODE_LINES = [
    "def {w}({v}):\n    return {v} + {n}\n",
    "for {v} in range({n}):\n    print({v})\n",
    "if {v} > {n}:\n    {w} = {v} * 2\n",
    "{w} = [{n}, {m}, {v}]\n",
    '{{"{w}": {n}, "{v}": "{m}"}}\n',
    "class {W}:\n    def __init__(self):\n        self.{v} = {n}\n",
]


def corpus(num_sentences: int = 6000, seed: int = 0) -> list[str]:
    """Deterministic training text: prose, numbers, code-like lines and chat turns."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_sentences):
        kind = i % 4
        if kind == 3:
            lines.append(_code_line(rng))
            continue
        words = rng.choices(_WORDS, k=rng.randint(4, 16))
        text = " ".join(words).capitalize() + rng.choice([".", ".", "!", "?", ",", ";"])
        if kind == 1:
            text += f" {rng.randint(0, 99999)} {rng.random():.3f}"
        if kind == 2:
            role = rng.choice(["system", "user", "assistant", "tool"])
            text = f"<|im_start|>{role}\n{text}<|im_end|>\n"
        lines.append(text)
    return lines


def _code_line(rng: random.Random) -> str:
    w, v = rng.choice(_WORDS), rng.choice("xyzijkn")
    return rng.choice(_CODE_LINES).format(
        w=w, W=w.capitalize(), v=v, n=rng.randint(0, 999), m=rng.randint(0, 999)
    )


def train_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer with `vocab_size` entries, special tokens first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    return tok


CHAT_TEMPLATE = (
    "{% macro text(content) %}"
    "{% if content is string %}{{ content }}"
    "{% elif content %}{% for part in content %}"
    "{% if part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ text(messages[0].content) }}\n\n{% endif %}"
    "# Tools{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message.role == 'system') %}"
    "<|im_start|>{{ message.role }}\n{{ text(message.content) }}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "{% for call in message.tool_calls %}"
    "{% set fn = call.function if call.function is defined else call %}"
    '{{ \'\\n\' }}<tool_call>{"name": "{{ fn.name }}", "arguments": '
    "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}</tool_call>"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(dest: Path, vocab_size: int, max_context: int, seed: int = 0) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json into `dest`; return the special token ids."""
    tok = train_tokenizer(vocab_size, seed)
    tok.save(str(dest / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": END_OF_TEXT,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_context,
        "chat_template": CHAT_TEMPLATE,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ids
