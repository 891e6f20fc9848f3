"""What a chat request may hand the chat template besides its messages and tools: vLLM's
``chat_template_kwargs`` (``{"enable_thinking": false}`` for Qwen3's template, ...).

As vLLM does (its ``resolve_chat_template_kwargs``), only the template's own variables pass; any
other key is dropped, so that none reaches ``apply_chat_template``'s own parameters
(``tokenize``, ``return_dict``, ...). The variables the server sets itself (the messages, the
tools, the generation prompt's switches) are dropped too: the request's own fields set those.
``chat_template`` and ``tokenize`` are refused, as vLLM refuses them.
"""

from __future__ import annotations

import jinja2
import jinja2.meta
import jinja2.sandbox

from jaxserve.exceptions import ValidationError

# Set by InputProcessor.tokenize_chat from the request's own fields.
_SERVER_SET = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                         "continue_final_message"})
_REFUSED = ("chat_template", "tokenize")


def template_variables(tokenizer) -> frozenset[str] | None:
    """The variables the tokenizer's chat template(s) read without defining them; None when a
    template does not parse here (it uses an extension only transformers loads): then every
    key but the server's passes."""
    templates = getattr(tokenizer, "chat_template", None) or {}
    if isinstance(templates, str):
        templates = {"default": templates}
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    names: set[str] = set()
    for source in templates.values():
        try:
            names |= jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateError:
            return None
    return frozenset(names)


def template_kwargs(requested: dict | None, variables: frozenset[str] | None) -> dict:
    """The part of a request's ``chat_template_kwargs`` the template gets.

    Raises:
      ValidationError: on ``chat_template_kwargs``, for a ``chat_template`` or ``tokenize`` key.
    """
    if not requested:
        return {}
    for key in _REFUSED:
        if key in requested:
            raise ValidationError(f"chat_template_kwargs: {key!r} cannot be set here",
                                  parameter="chat_template_kwargs")
    return {k: v for k, v in requested.items()
            if k not in _SERVER_SET and (variables is None or k in variables)}
