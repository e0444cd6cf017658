"""Chat templates: the one place that reads a template and renders a conversation through it, for
scripts/prepare_data.py --chat-template (SFT text) and the preference pairs of DPO (hybridtitan.data.preference).

    template = read_template("zebra", tok, key="dpo.chat_template")   # zebra, tokenizer or a .jinja file's path
    text = render(tok, template, messages, "row 3", key="dpo.chat_template")

``zebra`` is Zebra-Llama's template, shipped in hybridtitan/assets/chat_templates/; ``tokenizer`` the tokenizer's own
(None is returned: apply_chat_template then uses it). Every failure is a ValueError of one line that starts with
``key``.
"""

from __future__ import annotations

import os

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "chat_templates")


def read_template(spec: str, tok, key: str) -> str | None:
    """The Jinja text of template ``spec`` (None: the tokenizer's own, which it must have); ValueError in one line
    if the file cannot be read or does not parse."""
    if spec == "tokenizer":
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"{key} tokenizer: the tokenizer has no chat template (its tokenizer_config.json names "
                             "none); give zebra or a .jinja file")
        return None
    path = os.path.join(TEMPLATES, "zebra.jinja") if spec == "zebra" else spec
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{key}: cannot read {spec}: {e.strerror or e}") from None
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{key}: {spec} is not a valid Jinja template: line {e.lineno}: {e.message}") from None
    return text


def is_conversation(messages) -> bool:
    """A non-empty list of {"role": str, "content": str}."""
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)


def render(tok, template: str | None, messages, where: str, key: str, field: str = "messages",
           add_generation_prompt: bool = False) -> str:
    """The text of one conversation through the template; ValueError in one line naming ``where`` (the row) for
    messages that are not a list of {role, content} strings (``field``: the column they came from), or a template
    that fails on them."""
    if not is_conversation(messages):
        raise ValueError(f"{key}: {where}: {field!r} must be a non-empty list of "
                         f"{{\"role\": ..., \"content\": ...}} strings, got {str(messages)[:80]!r}")
    try:
        return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 -- a template's own error (raise_exception, a missing key): one line
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{key}: {where}: the template fails: {type(e).__name__}: {first}") from None
