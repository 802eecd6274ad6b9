"""The tiny checkpoints' tokenizer: a byte-level BPE trained on an embedded corpus, its ChatML
chat template and the files it writes (``tokenizer.json``, ``tokenizer_config.json``).

Deterministic: the corpus is fixed and BPE training breaks ties by a fixed order, so every call
gives the same ids. Used by :mod:`.make_tiny_model`.
"""
import json
import os

SPECIAL_TOKENS = ('<|endoftext|>', '<|im_start|>', '<|im_end|>')
TOKENIZER_VOCAB_SIZE = 1024

# ChatML; roles are checked so a typo fails loudly instead of producing an unseen prompt shape.
# Assistant tool calls render as the model writes them (Qwen3's layout): `<tool_call>\n{"name": ...,
# "arguments": ...}\n</tool_call>`, arguments given as a JSON string (as OpenAI clients send them)
# verbatim and a mapping with tojson, a newline before a call only after non-empty content or
# between calls; so a reply appended to the history re-renders to the tokens that were generated.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(start=0) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] + '\\n\\n' -}}{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    "{{- 'You may call these tools:\\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson) + '\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[ns.start:] -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unsupported chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- elif message['content'] is none -%}{%- set text = '' -%}"
    "{%- else -%}{%- set parts = namespace(text='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{%- set parts.text = parts.text + part['text'] -%}"
    "{%- elif part['type'] in ['image', 'image_url'] -%}"
    "{%- set parts.text = parts.text + '<|vision_start|><|image_pad|><|vision_end|>' -%}"
    "{%- endif -%}"
    "{%- endfor -%}{%- set text = parts.text -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- if text or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}"
    "{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")

_PROSE = """\
The river town woke slowly. Fishermen pulled their boats onto the gravel, and the baker opened
the shutters of a shop that smelled of bread and smoke. Children ran along the wall by the water,
counting the gulls that circled the market. Nobody was in a hurry on a morning like this one.
A traveller asked the way to the old library. "Go past the bridge, turn left at the fountain,
and keep walking until you see the clock tower," said the woman selling apples. He thanked her,
paid for two green apples, and walked on while the bells rang nine times.
The library kept maps, letters and ledgers from three hundred years of trade. Each ledger listed
what the ships carried: salt, wool, copper, glass, paper and tea. The keeper, a patient man with
ink on his fingers, said that every page tells a small story if you read it slowly enough.
Questions are good. Answers are better when they are short, correct and easy to check. When you
explain an idea, start with an example, then give the rule, then show where the rule stops.
The weather changed in the afternoon. Clouds came in from the sea, the wind turned cold, and the
first drops of rain tapped on the windows. People opened umbrellas and hurried home for dinner.
In the evening the lamps were lit one by one. Music came from an open door, someone laughed, and
a dog barked twice at the moon. Tomorrow there would be work again, but tonight there was time.
Please summarize the text above in one sentence. Then list three facts that it states, and one
question that it leaves open. Think step by step, and say which part of the text you used.
Hello! How can I help you today? I can answer questions, write code, translate a paragraph, or
plan a trip. Tell me what you need, and I will do my best to help.
User: What is the capital of France? Assistant: The capital of France is Paris.
User: Can you write a short poem about the sea? Assistant: Grey waves fold over, the tide keeps
time, and every shell on the sand remembers a storm.
User: Translate "good morning" into Spanish. Assistant: "Buenos dias."
User: Why is the sky blue? Assistant: Sunlight scatters off the air, and blue light scatters
more than red light, so the sky looks blue during the day and red near sunset.
A good recipe for soup: chop two onions, three carrots and a stalk of celery. Warm some oil in
a large pot, add the vegetables, and cook them gently for ten minutes. Pour in a litre of stock,
add salt and pepper, and let it simmer for half an hour. Serve it hot with fresh bread.
The meeting is on Monday at 10:30 in room 4B. Please bring the report, the budget for next year,
and your ideas for the spring campaign. If you cannot come, send a note to the team before Friday.
Science begins with careful observation. A scientist writes down what she sees, forms a guess
about the cause, and designs an experiment that could prove the guess wrong. If the experiment
agrees with the guess many times, the idea becomes a theory, but it can still be revised later.
"""

_CODE = """\
def add(a, b):
    return a + b

def mean(values: list[float]) -> float:
    if not values:
        raise ValueError("values must not be empty")
    return sum(values) / len(values)

class Counter:
    def __init__(self):
        self.count = 0

    def step(self, n=1):
        self.count += n
        return self.count

for i in range(10):
    print(f"step {i}: {i * i}")

import json, os, sys
data = {"name": "tiny", "layers": 4, "heads": [4, 2], "ok": True}
print(json.dumps(data, indent=2))
x = [1, 2, 3]; y = (4, 5); z = {6: "six"}
if x and y or not z:
    pass
# TODO: check the edge cases <= >= != == -> => :: && || ... !? @ # $ % ^ & * ~ `
SELECT id, name FROM users WHERE age > 21 ORDER BY name;
curl -s http://127.0.0.1:23333/v1/chat/completions -H 'Content-Type: application/json'
"""


def _corpus() -> list[str]:
    """Return the fixed training corpus (about 10 KB) as a list of lines; same every call."""
    lines = _PROSE.splitlines() + _CODE.splitlines()
    # Generated arithmetic, dates and prices add digits and punctuation in many contexts.
    for i in range(80):
        a, b = (i * 37) % 101, (i * 53 + 7) % 97
        lines.append(f'{a} + {b} = {a + b}; {a} * {b} = {a * b}.')
        lines.append(f'On {2000 + i % 25}-{1 + i % 12:02d}-{1 + i % 28:02d} the price was ${a}.{b:02d} (up {i % 9}%).')
    return lines


def train_tokenizer(extra_special: tuple = ()):
    """Train the byte-level BPE tokenizer on the embedded corpus.

    Returns a `tokenizers.Tokenizer` with at most `TOKENIZER_VOCAB_SIZE` entries whose first ids
    are `SPECIAL_TOKENS` (0, 1, 2), then `extra_special` (3, ...). Deterministic: the corpus is
    fixed and BPE training breaks ties by a fixed order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_SIZE,
                                  # The corpus is small; counting pairs seen once is what reaches ~1000 tokens.
                                  min_frequency=1,
                                  special_tokens=list(SPECIAL_TOKENS) + list(extra_special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def write_json(path: str, obj: dict) -> None:
    """Write `obj` to `path` as indented JSON with sorted keys (stable bytes for the checkpoint hashes)."""
    with open(path, 'w', encoding='utf-8') as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + '\n')


def write_tokenizer(tok, out_dir: str, extra_special: tuple = ()) -> None:
    """Write the trained tokenizer `tok` into `out_dir` as transformers loads it (tokenizer.json and
    its config, with `extra_special` tokens added as special)."""
    tok.save(os.path.join(out_dir, 'tokenizer.json'), pretty=True)
    added = {
        str(tok.token_to_id(t)): {
            'content': t, 'lstrip': False, 'normalized': False, 'rstrip': False,
            'single_word': False, 'special': True
        }
        for t in SPECIAL_TOKENS + tuple(extra_special)
    }
    write_json(
        os.path.join(out_dir, 'tokenizer_config.json'), {
            'added_tokens_decoder': added,
            'bos_token': None,
            'chat_template': CHAT_TEMPLATE,
            'clean_up_tokenization_spaces': False,
            'eos_token': '<|im_end|>',
            'model_max_length': 32768,
            'pad_token': '<|endoftext|>',
            'tokenizer_class': 'PreTrainedTokenizerFast',
        })
