"""A custom agent loop in verl's shape (`AgentLoopBase`), run by lathe (examples/gsm8k_custom_agent.sh).

The model answers a GSM8K question; when its answer has no final "#### <number>" line, the loop adds a user turn
asking for one and lets the model answer again (at most `max_turns` model turns). Only the model's tokens are trained
(`response_mask` 0 on the reminder); the reward function scores the last answer. From verl, only the import changes:
`from verl.experimental.agent_loop import ...` is `from lathe.rollout.agent.custom import ...`.
"""

from __future__ import annotations

from typing import Any

from lathe.rollout.agent.custom import AgentLoopBase, AgentLoopOutput, simple_timer

REMINDER = "Give your final answer on its own line as '#### <number>'."


class SelfCheckAgentLoop(AgentLoopBase):
    def __init__(self, *args, max_turns: int = 2, reminder: str = REMINDER, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_turns, self.reminder = max_turns, reminder

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        prompt = await self.ct_build_initial_tokens(messages)
        budget = self.rollout_config.response_length
        ids, mask, logprobs, turns, timing = list(prompt), [], [], 1, {"generate_sequences": 0.0}
        for turn in range(self.max_turns):
            spent = {}
            with simple_timer("generate_sequences", spent):
                out = await self.server_manager.generate(request_id=f"{kwargs.get('uid')}", prompt_ids=ids,
                                                         sampling_params={**sampling_params,
                                                                          "max_tokens": budget - len(mask)})
            timing["generate_sequences"] += spent["generate_sequences"]
            merged, mask, logprobs = await self.ct_merge_assistant_token(ids, out.token_ids, mask, logprobs,
                                                                         out.log_probs)
            ids, turns = merged.token_ids, turns + 1
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            said = messages + [{"role": "assistant", "content": text}]
            if "####" in text or turn + 1 == self.max_turns or out.stop_reason == "length" or len(mask) >= budget:
                break
            asked = said + [{"role": "user", "content": self.reminder}]
            merged, mask, logprobs = await self.ct_merge_non_assistant_msg(said, asked, ids, mask, logprobs)
            ids, messages, turns = merged.token_ids, asked, turns + 1
            if len(mask) >= budget:                 # no room left for another answer
                break
        return AgentLoopOutput(prompt_ids=prompt, response_ids=ids[len(prompt):][:budget], response_mask=mask[:budget],
                               response_logprobs=logprobs[:budget], num_turns=turns, metrics=timing)
