"""A tiny model directory whose chat template renders everything a request can put into a prompt (tools as JSON,
reasoning_content, an assistant's tool calls with their arguments), for the tests of what reaches the prompt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOOL_TEMPLATE = (
    "{% if tools %}<|system|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def templated_model_dir(model_dir: Path, path: Path) -> Path:
    """A copy of `model_dir` (config, weights, tokenizer) at `path`, its tokenizer carrying TOOL_TEMPLATE."""
    shutil.copytree(model_dir, path, dirs_exist_ok=True)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config_file.write_text(json.dumps(config))
    return path
