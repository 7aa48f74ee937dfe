"""LLM.chat as in vLLM: one conversation or a list of them, the chat template applied
(the model's, the `chat_template` option's, or the call's), RequestOutputs back."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import ConfigError

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
HELLO = [{"role": "user", "content": "Hello there."}]
BYE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bye."}]
GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=tiny_model_factory(), dtype="float32", num_kv_blocks=64)


def test_one_conversation_is_the_templated_prompt_generated(llm):
    [out] = llm.chat(HELLO, GREEDY)
    expected = llm.tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
    assert out.prompt_token_ids == list(expected)
    [direct] = llm.generate([list(expected)], GREEDY)
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids


def test_a_list_of_conversations_gives_one_output_each_in_order(llm):
    outs = llm.chat([HELLO, BYE], [GREEDY, SamplingParams(max_tokens=2, temperature=0)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 2]
    assert outs[0].prompt_token_ids == llm.chat(HELLO, GREEDY)[0].prompt_token_ids
    assert outs[0].prompt_token_ids != outs[1].prompt_token_ids


def test_the_calls_template_replaces_the_models(llm):
    [out] = llm.chat(BYE, GREEDY, chat_template=TEMPLATE)
    rendered = "[system] Be brief.\n[user] Bye.\n[assistant]"
    assert out.prompt_token_ids == llm.tokenizer(rendered, add_special_tokens=False).input_ids


def test_the_chat_template_option_takes_a_file(tiny_model_factory, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    with LLM(model=tiny_model_factory(), dtype="float32", num_kv_blocks=16, chat_template=str(path)) as llm:
        [out] = llm.chat(HELLO, GREEDY)
        assert out.prompt_token_ids == llm.tokenizer("[user] Hello there.\n[assistant]",
                                                     add_special_tokens=False).input_ids


def test_a_chat_template_that_is_neither_file_nor_template_is_refused(tiny_model_factory):
    with pytest.raises(ConfigError, match=r"^chat_template: "):
        LLM(model=tiny_model_factory(), chat_template="missing/template.jinja")
