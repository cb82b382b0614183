"""`lathe.rollout.agent.render`: the tokens the agent loop appends between model turns are the chat template's own
rendering, token for token, on a Qwen2.5-style template; templates that cannot do that are refused with the reason."""

import pytest

from lathe.rollout.agent.render import ConversationRenderer, TemplateError

from helpers import qwen_style_tokenizer

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Arithmetic.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def rendered(tok, messages, **kw):
    return ids(tok, tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, **kw))


@pytest.mark.parametrize("answers", [["42"], ["42", "no error"]], ids=["one-answer", "two-answers-one-user-turn"])
def test_a_trajectory_is_the_templates_rendering_of_the_conversation(qwen_tok, answers):
    tok = qwen_tok
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    r = ConversationRenderer(tok, tools=TOOLS)
    assert r.end_of_turn == im_end and r.stop_ids() == [im_end]
    user = [{"role": "user", "content": "What is 6*7?"}]
    turn1 = ids(tok, "Let me compute.\n" + CALL) + [im_end]          # as the model samples them, with its stop
    turn2 = ids(tok, "It is 42.") + [im_end]
    seq = rendered(tok, user, add_generation_prompt=True) + turn1
    seq += r.close_turn(turn1) + r.messages_delta([{"role": "tool", "content": a} for a in answers])
    seq += turn2 + r.close_turn(turn2)
    conversation = user + [{"role": "assistant", "content": "Let me compute.\n" + CALL}]
    conversation += [{"role": "tool", "content": a} for a in answers]
    conversation += [{"role": "assistant", "content": "It is 42."}]
    assert seq == rendered(tok, conversation)


def test_a_turn_stopped_by_another_token_gets_the_whole_end_marker(qwen_tok):
    r = ConversationRenderer(qwen_tok, tools=TOOLS)
    eos = qwen_tok.eos_token_id
    assert r.close_turn([5, 6, eos]) == r.turn_tail == ids(qwen_tok, "<|im_end|>\n")
    assert r.close_turn([5, 6, r.end_of_turn]) == ids(qwen_tok, "\n")


def test_the_builtin_template_ends_a_turn_with_its_end_token():
    from lathe.data.builtin import builtin_tokenizer
    tok = builtin_tokenizer()
    r = ConversationRenderer(tok)
    assert r.stop_ids() == [tok.convert_tokens_to_ids("<|end|>")]
    assert tok.decode(r.messages_delta([{"role": "tool", "content": "7"}])) == "<|tool|>7<|end|><|assistant|>"


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tok = qwen_style_tokenizer()
    tok.chat_template = "{{ messages | length }}" + tok.chat_template      # the header counts the messages
    with pytest.raises(TemplateError, match="not a prefix"):
        ConversationRenderer(tok, tools=TOOLS).messages_delta([{"role": "tool", "content": "42"}])


def test_a_template_without_tool_messages_is_refused_with_the_fix():
    tok = qwen_style_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                         "{% endif %}{{ m['content'] }}<|im_end|>{% endfor %}")
    with pytest.raises(TemplateError, match="supports tools"):
        ConversationRenderer(tok).messages_delta([{"role": "tool", "content": "42"}])
