"""Minimal chat templates that reproduce each family's tool-call format, for tiny random-weight
models in end-to-end tests. Each renders the tool definitions, assistant tool calls and tool
results the way the family's own template does, reduced to what the format needs. Sources (the
format descriptions these follow):

* qwen3-hermes: Qwen3 chat template / https://qwen.readthedocs.io/en/latest/framework/function_call.html
* qwen3-xml: Qwen3-Coder chat template (https://huggingface.co/Qwen/Qwen3-Coder-30B-A3B-Instruct)
* llama: https://www.llama.com/docs/model-cards-and-prompt-formats/llama3_1/ (JSON tool calling)
* mistral: https://docs.mistral.ai/guides/tokenization/ ([AVAILABLE_TOOLS], [TOOL_CALLS]...[ARGS])
* gpt-oss: https://github.com/openai/harmony docs/format.md (channels, functions.NAME recipients)
* glm: GLM-4.5 chat template (https://huggingface.co/zai-org/GLM-4.5)
* deepseek: DeepSeek-V3.1 chat template (https://huggingface.co/deepseek-ai/DeepSeek-V3.1)
* kimi: Kimi-K2 tool-call guide (https://huggingface.co/moonshotai/Kimi-K2-Instruct, docs/tool_call_guidance.md)
* gemma4: Gemma 4 chat template (https://huggingface.co/google/gemma-4-31B-it) and
  https://ai.google.dev/gemma/docs/capabilities/function-calling (object notation, ``<|"|>`` strings)
"""

from __future__ import annotations

HERMES = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% endif %}{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

QWEN3_XML = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
Call: <tool_call>
<function=NAME>
<parameter=KEY>
VALUE
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>
<function={{ c.function.name }}>
{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA = """<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>

{% if m.role == 'user' and tools and loop.last %}Answer with a JSON function call {"name": function name, "parameters": arguments}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}{% if m.tool_calls %}{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """<s>{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{% for m in messages %}{% if m.role == 'user' or m.role == 'system' %}[INST]{{ m.content }}[/INST]{% elif m.role == 'assistant' %}{{ m.content or '' }}{% for c in m.tool_calls or [] %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}</s>{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}"""

GPT_OSS = """{% if tools %}<|start|>developer<|message|># Tools
namespace functions {
{% for t in tools %}// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}}<|end|>{% endif %}{% for m in messages %}{% if m.role == 'assistant' %}{% if m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>{{ c.function.arguments | tojson }}<|call|>{% endfor %}{% else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}{% elif m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"""

GLM = """[gMASK]<sop>{% if tools %}<|system|>
# Tools
{% for t in tools %}{{ t | tojson }}
{% endfor %}Call: <tool_call>NAME
<arg_key>KEY</arg_key>
<arg_value>VALUE</arg_value>
</tool_call>{% endif %}{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>
{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}
{% for k, v in c.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v if v is string else v | tojson }}</arg_value>
{% endfor %}</tool_call>{% endfor %}{% elif m.role == 'tool' %}<|observation|>
<tool_response>{{ m.content }}</tool_response>{% else %}<|{{ m.role }}|>
{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>
<think></think>
{% endif %}"""

DEEPSEEK = """<｜begin▁of▁sentence｜>{% if tools %}## Tools
{% for t in tools %}{{ t | tojson }}
{% endfor %}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜><｜tool▁calls▁end｜>{% endif %}{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% elif m.role == 'assistant' %}<｜Assistant｜></think>{{ m.content or '' }}{% if m.tool_calls %}<｜tool▁calls▁begin｜>{% for c in m.tool_calls %}<｜tool▁call▁begin｜>{{ c.function.name }}<｜tool▁sep｜>{{ c.function.arguments | tojson }}<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>{% else %}{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"""

KIMI = """{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}{% for m in messages %}{% if m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}{% if m.tool_calls %}<|tool_calls_section_begin|>{% for c in m.tool_calls %}<|tool_call_begin|>functions.{{ c.function.name }}:{{ loop.index0 }}<|tool_call_argument_begin|>{{ c.function.arguments | tojson }}<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>{% endif %}<|im_end|>{% elif m.role == 'tool' %}<|im_system|>tool<|im_middle|>{{ m.content }}<|im_end|>{% else %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"""

GEMMA4 = """<bos>{% if tools %}<|turn>system
{% for t in tools %}<|tool>declaration:{{ t.function.name }}{{ t.function | tojson }}<tool|>{% endfor %}<turn|>
{% endif %}{% for m in messages %}{% if m.role == 'assistant' %}<|turn>model
{{ m.content or '' }}{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}{{ '{' }}{% for k, v in c.function.arguments.items() %}{{ k }}:{% if v is string %}<|"|>{{ v }}<|"|>{% else %}{{ v | tojson }}{% endif %}{{ ',' if not loop.last }}{% endfor %}{{ '}' }}<tool_call|>{% endfor %}<turn|>
{% elif m.role == 'tool' %}<|turn>user
<|tool_response>response:{{ m.name or 'tool' }}{value:<|"|>{{ m.content }}<|"|>}<tool_response|><turn|>
{% else %}<|turn>{{ m.role }}
{{ m.content }}<turn|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|turn>model
{% endif %}"""

TEMPLATES = {
    "qwen3-hermes": HERMES,
    "qwen3-xml": QWEN3_XML,
    "llama": LLAMA,
    "mistral": MISTRAL,
    "gpt-oss": GPT_OSS,
    "glm": GLM,
    "deepseek": DEEPSEEK,
    "kimi": KIMI,
    "gemma4": GEMMA4,
}

#: Marker strings each family's tokenizer has as special tokens (added to a tiny model's tokenizer).
SPECIAL_TOKENS = {
    "mistral": ["[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[INST]", "[/INST]"],
    "gemma4": ["<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'],
}
