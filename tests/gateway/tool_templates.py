"""Chat templates with tool support, for tests (no shipped test model has one): a Hermes one in
the shape of Qwen 2.5's (ChatML, as SmolLM2 speaks it), and a Llama 3.1-style JSON one."""

from __future__ import annotations

HERMES = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}\
{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, \
"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or \
(message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
{{- tool_call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}\
{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}\
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA3_JSON = """\
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' and loop.first and tools %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please \
respond with a JSON for a function call with its proper arguments that best answers the \
given prompt.\\n\\nRespond in the format {"name": function name, "parameters": dictionary of \
argument name and its value}. Do not use variables.\\n\\n' }}
{%- for tool in tools %}{{- tool | tojson + '\\n\\n' }}{%- endfor %}
{{- message.content + '<|eot_id|>' }}
{%- elif message.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- for tool_call in message.tool_calls %}
{{- '{"name": "' + tool_call.function.name + '", "parameters": ' }}
{{- tool_call.function.arguments | tojson + '}' }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + \
'<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\
{%- endif %}
"""
