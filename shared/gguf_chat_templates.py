"""Chat templates for GGUF files that carry none (``tokenizer.chat_template`` missing).

llama.cpp falls back to ChatML for such a file, which a model trained on other turn markers does
not follow. Here a file gets its family's own format when its vocabulary has that family's turn
tokens; otherwise it gets no template (chat requests are refused, completions still work).
"""
from __future__ import annotations

from typing import Collection

# Gemma's turns (Google's template for Gemma 3): no system role, so a system message is put before
# the first user message; "assistant" is "model"; the text always starts with <bos>.
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

_BY_TURN_TOKENS = ((("<start_of_turn>", "<end_of_turn>"), GEMMA_TEMPLATE),)


def fallback_chat_template(tokens: Collection[str]) -> str | None:
    """The template of the family whose turn tokens `tokens` (the vocabulary) has, if any."""
    present = set(tokens)
    for needed, template in _BY_TURN_TOKENS:
        if present.issuperset(needed):
            return template
    return None
