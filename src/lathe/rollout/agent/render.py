"""The tokens a conversation gains between two model turns, exactly as the chat template renders them.

A trajectory's tokens are never re-tokenised: the model's own tokens stay as sampled, and what the agent loop
appends after a turn (the rest of the turn's end marker, the tool answers, the next generation prompt) is the
chat template's own text for those messages, cut out of a rendering of a fixed stand-in conversation:

    base  = render([user "x", assistant MARK])                  # ends with the assistant turn's end marker
    delta = render([user "x", assistant MARK, *tool_messages], add_generation_prompt=True)[len(base):]

so `prompt + turn 1 + tail + delta + turn 2 ...` equals the template's rendering of the whole conversation (with
the model's turns decoded), token for token, whenever the model's turns are the tokenizer's own encoding of their
text (tests/rollout/agent/test_render.py checks it on a Qwen-style template). A template whose rendering of a
conversation is not a prefix of its rendering of that conversation continued (some templates rewrite earlier
turns) is refused with the reason.
"""

from __future__ import annotations

MARK = "\u2063lathe-turn\u2063"           # content no real message has (invisible separators around a word)
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": MARK}]


class TemplateError(ValueError):
    """The chat template cannot render tool turns the way the agent loop needs."""


class ConversationRenderer:
    """Token pieces of a chat template for the agent loop (see the module docstring).

    `turn_tail`: the tokens the template puts after an assistant message's content (Qwen: `<|im_end|>`, "\\n");
    `end_of_turn`: its first token when that is a special token (the model ends a turn with it: a stop token).
    """

    def __init__(self, tokenizer, *, tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or None
        base = self._render(_BASE)
        at = base.rfind(MARK)
        if at < 0:
            raise TemplateError("the chat template dropped an assistant message's content; the agent loop needs a "
                                "template that renders assistant turns (set a chat template that does)")
        self.base_text = base
        self.turn_tail = self._ids(base[at + len(MARK):])
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.end_of_turn = self.turn_tail[0] if self.turn_tail and self.turn_tail[0] in special else None

    def _render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as e:                # jinja's TemplateError and friends
            raise TemplateError(f"the chat template failed on a tool conversation ({type(e).__name__}: {e}); the "
                                "agent loop renders 'tool' messages: use a template that supports tools "
                                "(Qwen2.5/Qwen3, Llama 3.1+) or set one that does") from None

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def stop_ids(self) -> list[int]:
        """Tokens that end a model turn: the template's end-of-turn token, when it has one."""
        return [self.end_of_turn] if self.end_of_turn is not None else []

    def close_turn(self, turn_ids: list[int]) -> list[int]:
        """What follows a finished model turn before the next message: the rest of the template's tail when the turn
        ended with the end-of-turn token, the whole tail when it ended otherwise (another stop token)."""
        if self.end_of_turn is not None and turn_ids and turn_ids[-1] == self.end_of_turn:
            return list(self.turn_tail[1:])
        return list(self.turn_tail)

    def messages_delta(self, messages: list[dict]) -> list[int]:
        """The tokens of `messages` (tool answers, a user turn) plus the next generation prompt, as the template
        renders them after an assistant turn."""
        full = self._render(_BASE + list(messages), add_generation_prompt=True)
        if not full.startswith(self.base_text):
            raise TemplateError("the chat template renders a conversation differently once tool messages follow it "
                                "(its rendering is not a prefix of the continued one), so tool answers cannot be "
                                "appended token-exactly; use a template without that rewrite")
        return self._ids(full[len(self.base_text):])
