"""`lathe.rollout.agent.interactions`: simulated users (verl's interactions) in the agent loop, on a scripted engine:
the user's answers are rendered as the template renders a user turn, their scores reach the reward function as
`turn_scores`, the conversation ends when the user says so or at `max_user_turns`; bad configs name the file."""

import pytest

from lathe.generation import SamplingParams
from lathe.rollout.agent.interactions import BaseInteraction, Gsm8kInteraction, InteractionSet, load_interactions
from lathe.rollout.agent.tools import ToolConfigError

from rollout.agent.test_loop import loop_for, prompt_of
from rollout.agent.test_render import ids, rendered


def gsm8k_users():
    return InteractionSet({"gsm8k": Gsm8kInteraction({"name": "gsm8k"})})


def test_the_user_answers_until_the_answer_is_right(qwen_tok):
    turns = ["I think #### 41", "Sorry: #### 42"]
    engine, loop = loop_for(qwen_tok, [turns])
    loop.interactions = gsm8k_users()
    user = [{"role": "user", "content": "What is 6*7?"}]
    out = loop.generate([prompt_of(qwen_tok)], SamplingParams(seed=0), messages=[user],
                        interaction_kwargs=[{"name": "gsm8k", "ground_truth": "42"}])
    wrong = "Your response is incorrect! You need to reflect on your answer and try again."
    conversation = user + [{"role": "assistant", "content": turns[0]}, {"role": "user", "content": wrong},
                           {"role": "assistant", "content": turns[1]}]
    assert prompt_of(qwen_tok) + out.token_ids[0] == rendered(qwen_tok, conversation)[:-1]
    assert out.turn_scores == [[0.0, 1.0]] and out.num_turns == [4] and out.finish_reasons == ["stop"]
    trained = [t for t, m in zip(out.token_ids[0], out.loss_masks[0]) if m]
    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    assert trained == ids(qwen_tok, turns[0]) + [im_end] + ids(qwen_tok, turns[1]) + [im_end]


def test_max_user_turns_ends_the_conversation(qwen_tok):
    engine, loop = loop_for(qwen_tok, [["#### 1", "#### 2", "#### 3"]], max_user_turns=1)
    loop.interactions = gsm8k_users()
    out = loop.generate([prompt_of(qwen_tok)], SamplingParams(seed=0), interaction_kwargs=[{"ground_truth": "42"}])
    assert len(engine.requests) == 2 and out.turn_scores == [[0.0]] and out.num_turns == [4]


def test_rows_without_interaction_kwargs_are_single_turn_and_a_failing_user_ends_only_its_trajectory(qwen_tok):
    class Broken(BaseInteraction):
        async def generate_response(self, instance_id, messages, **kwargs):
            raise RuntimeError("the simulator is down")

    _, loop = loop_for(qwen_tok, [["#### 1", "#### 2"], ["#### 1", "#### 2"]])
    loop.interactions = InteractionSet({"b": Broken({"name": "b"})})
    out = loop.generate([prompt_of(qwen_tok)] * 2, SamplingParams(seed=0), interaction_kwargs=[None, {"name": "b"}])
    assert out.num_turns == [2, 2] and out.turn_scores == [[], [0.0]] and out.finish_reasons == ["stop", "stop"]


def test_verls_interaction_config_loads_and_mistakes_name_the_file(tmp_path):
    good = tmp_path / "users.yaml"
    good.write_text("interaction:\n  - name: gsm8k\n    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n"
                    "    config: {}\n")
    assert isinstance(load_interactions(good).interactions["gsm8k"], Gsm8kInteraction)
    for text, match in [("interaction: []\n", "needs a top-level 'interaction:' list"),
                        ("interaction:\n  - name: x\n    class_name: verl.interactions.other.X\n", "no equivalent"),
                        ("interaction:\n  - name: x\n    class_name: no_such_module.X\n", "cannot be imported"),
                        ("interaction:\n  - {name: a, class_name: lathe.rollout.agent.interactions.Gsm8kInteraction}\n"
                         "  - {name: a, class_name: lathe.rollout.agent.interactions.Gsm8kInteraction}\n",
                         "already used")]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ToolConfigError, match=match) as err:
            load_interactions(bad)
        assert str(bad) in str(err.value)
    with pytest.raises(ValueError, match="the interactions are"):
        InteractionSet({"a": Gsm8kInteraction(), "b": Gsm8kInteraction()}).open("t", {"ground_truth": "1"})
