"""Chat templates for the API tests, written into copies of the tiny model directories.

``THINKING_TOOLS_TEMPLATE`` follows the shape of Qwen3's template (our own Jinja): tools are
listed in the system turn inside ``<tools></tools>``, assistant calls are rendered as
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, consecutive tool results go into
one user turn inside ``<tool_response>`` tags, and ``enable_thinking=False`` writes an empty
``<think>`` block into the generation prompt. Text parts are joined; other roles are refused.
"""
from __future__ import annotations

import json
import os

THINKING_TOOLS_TEMPLATE = (
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{- c -}}"
    "{%- elif c is iterable -%}{%- for p in c -%}{%- if p['type'] == 'text' -%}{{- p['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set first_system = messages and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if first_system -%}{{- text(messages[0]['content']) + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nFunctions you may call are listed inside <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call one, reply with <tool_call>\\n{\"name\": <name>, \"arguments\": <json object>}"
    "\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif first_system -%}"
    "{{- '<|im_start|>system\\n' + text(messages[0]['content']) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' and loop.first -%}"
    "{%- elif m['role'] in ['user', 'system'] -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + text(m['content']) + '<|im_end|>\\n' -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + text(m['content']) -}}"
    "{%- for call in m['tool_calls'] or [] -%}"
    "{%- if not loop.first or text(m['content']) -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set fn = call['function'] -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}"
    "{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + text(m['content']) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- raise_exception('unsupported chat role: ' + m['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}")


# Qwen3.5-style XML tool calls (our own Jinja, the layout of Qwen3.5 / Qwen3-Coder templates): each
# call is <tool_call>\n<function=NAME>\n then <parameter=KEY>\nVALUE\n</parameter>\n per argument
# (a string value printed as it is, any other as JSON), </function>\n</tool_call>; the first call
# follows non-empty content after a blank line; an assistant turn opens with its think block; the
# generation prompt opens <think>\n unless enable_thinking is false.
QWEN_XML_TEMPLATE = (
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{- c -}}"
    "{%- elif c is iterable -%}{%- for p in c -%}{%- if p['type'] == 'text' -%}{{- p['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set first_system = messages and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if first_system -%}{{- text(messages[0]['content']) + '\n\n' -}}{%- endif -%}"
    "{{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\n</tools>\n\nTo call a function reply in this format:\n\n<tool_call>\n<function=example_function_name>"
    "\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n' -}}"
    "{%- elif first_system -%}"
    "{{- '<|im_start|>system\n' + text(messages[0]['content']) + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' and loop.first -%}"
    "{%- elif m['role'] in ['user', 'system'] -%}"
    "{{- '<|im_start|>' + m['role'] + '\n' + text(m['content']) + '<|im_end|>\n' -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\n<think>\n' + (m['reasoning_content'] or '') + '\n</think>\n\n' -}}"
    "{{- text(m['content']) -}}"
    "{%- for call in m['tool_calls'] or [] -%}"
    "{%- set fn = call['function'] -%}"
    "{%- if loop.first -%}{%- if text(m['content']) | trim -%}{{- '\n\n' -}}{%- endif -%}"
    "{%- else -%}{{- '\n' -}}{%- endif -%}"
    "{{- '<tool_call>\n<function=' + fn['name'] + '>\n' -}}"
    "{%- if fn['arguments'] is mapping -%}"
    "{%- for key, value in fn['arguments'] | items -%}"
    "{{- '<parameter=' + key + '>\n' -}}"
    "{%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}"
    "{{- '\n</parameter>\n' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '</function>\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\n<tool_response>\n' + text(m['content']) + '\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}"
    "{%- else -%}{{- raise_exception('unsupported chat role: ' + m['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\n\n</think>\n\n' -}}"
    "{%- else -%}{{- '<think>\n' -}}{%- endif -%}"
    "{%- endif -%}")


def with_template(model_dir: str, out_dir: str, template: str) -> str:
    """A copy of ``model_dir`` in ``out_dir`` (files symlinked) whose tokenizer uses ``template``."""
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(model_dir):
        if name != 'tokenizer_config.json':
            os.symlink(os.path.join(model_dir, name), os.path.join(out_dir, name))
    with open(os.path.join(model_dir, 'tokenizer_config.json')) as f:
        config = json.load(f)
    config['chat_template'] = template
    with open(os.path.join(out_dir, 'tokenizer_config.json'), 'w') as f:
        json.dump(config, f, indent=2)
    return out_dir
