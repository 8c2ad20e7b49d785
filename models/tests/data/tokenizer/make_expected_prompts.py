#!/usr/bin/env python3
"""Regenerates expected_prompts.json: what `transformers` renders for each test conversation.

tests/tokenizer_chat.rs renders the same conversations with rackfill's minijinja port and must get
byte-identical prompts (or the same `raise_exception` message). The reference is the renderer
behind `tokenizer.apply_chat_template` (`transformers.utils.chat_template_utils`), fed the
template and special tokens the way `load_chat_template` finds them in each directory.

Usage: python3 make_expected_prompts.py   (needs `pip install transformers jinja2`)
"""

import json
from pathlib import Path

from transformers.utils.chat_template_utils import render_jinja_template

HERE = Path(__file__).resolve().parent


def load(directory):
    config = json.loads((HERE / directory / "tokenizer_config.json").read_text())
    jinja = HERE / directory / "chat_template.jinja"
    source = jinja.read_text() if jinja.exists() else config["chat_template"]

    def token(key):
        value = config.get(key)
        return value["content"] if isinstance(value, dict) else value

    return source, token("bos_token"), token("eos_token")


def turns(*pairs):
    return [{"role": role, "content": content} for role, content in pairs]


CASES = [
    ("qwen3", turns(("system", "You are a helpful assistant."), ("user", "Hello")), True, {}),
    ("qwen3", turns(("user", "Hello")), False, {}),
    ("qwen3", turns(("user", "Hello")), True, {"enable_thinking": False}),
    (
        "qwen3",
        turns(
            ("user", "What is 2+2?"),
            ("assistant", "<think>\nAdd them.\n</think>\n\n4"),
            ("user", "And 3+3?"),
            ("assistant", "<think>\nAgain.\n</think>\n\n6"),
        ),
        False,
        {},
    ),
    ("qwen3", turns(("system", "S"), ("user", "<tool_response>\nr\n</tool_response>"), ("system", "late")), True, {}),
    ("qwen2", turns(("user", "Hi")), True, {}),
    ("qwen2", turns(("system", "Sys."), ("user", "Hi"), ("assistant", "Yo")), False, {}),
    ("mistral", turns(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")), True, {}),
    ("mistral", turns(("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")), False, {}),
    ("mistral", turns(("user", "a"), ("user", "b")), True, {}),
    ("mistral", turns(("user", "a"), ("tool", "b")), True, {}),
    (
        "deepseek_v3",
        turns(("system", "You are a helpful assistant"), ("user", "Hello"), ("assistant", "Hi there"), ("user", "How are you?")),
        True,
        {},
    ),
    ("deepseek_v3", turns(("system", "Rule one."), ("system", "Rule two."), ("user", "Hello"), ("assistant", "Hi")), False, {}),
    ("deepseek_v3", turns(("user", "Ünïcödé 你好 😀")), True, {}),
]


def main() -> None:
    out = []
    for directory, messages, add_generation_prompt, kwargs in CASES:
        source, bos, eos = load(directory)
        case = {
            "dir": directory,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "kwargs": kwargs,
        }
        try:
            # Like tokenizer.special_tokens_map: tokens that are None are left out.
            special = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
            rendered, _ = render_jinja_template(
                [messages],
                chat_template=source,
                add_generation_prompt=add_generation_prompt,
                **special,
                **kwargs,
            )
            case["prompt"] = rendered[0]
        except Exception as e:  # raise_exception in the template
            case["error"] = str(e)
        out.append(case)
    path = HERE / "expected_prompts.json"
    path.write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {path} ({len(out)} cases)")


if __name__ == "__main__":
    main()
