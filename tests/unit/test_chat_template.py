"""vLLM's ``chat_template_kwargs`` (jaxserve/engine/chat_template.py): only the template's own
variables reach it, the server's own are never overridden, and keys that would change what
``apply_chat_template`` returns are refused."""

import pytest
from transformers import PreTrainedTokenizerFast
from tokenizers import Tokenizer, models

from jaxserve.engine.chat_template import template_kwargs, template_variables
from jaxserve.exceptions import ValidationError

TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% if enable_thinking is false %} "
            "(no thinking){% endif %}{% endif %}")


def _tokenizer(template):
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, "x")))
    tok.chat_template = template
    return tok


def test_only_the_templates_variables_pass():
    variables = template_variables(_tokenizer(TEMPLATE))
    assert {"messages", "add_generation_prompt", "enable_thinking"} <= variables
    assert template_kwargs({"enable_thinking": False, "return_dict": True, "other": 1,
                            "add_generation_prompt": False, "messages": []},
                           variables) == {"enable_thinking": False}
    assert template_kwargs(None, variables) == {}


@pytest.mark.parametrize("key", ["chat_template", "tokenize"])
def test_refused_keys_name_the_field(key):
    with pytest.raises(ValidationError) as e:
        template_kwargs({key: True}, frozenset())
    assert e.value.parameter == "chat_template_kwargs"


def test_a_template_that_does_not_parse_here_passes_all_but_the_servers():
    assert template_variables(_tokenizer("{% generation %}x{% endgeneration %}")) is None
    assert template_kwargs({"a": 1, "tools": []}, None) == {"a": 1}
