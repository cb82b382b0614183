"""`lathe.rollout.agent.loop`: trajectories, loss masks, caps, budgets and concurrency on a scripted engine; on lathe's
real engine, the loop with no tool calls samples exactly what single-turn generation samples, and later turns find
the conversation in the prefix cache (on a hybrid model, in the turn the engine parked)."""

import threading
import time
from dataclasses import dataclass, replace

import pytest
import torch

from lathe.engine.llm_engine import LatheEngine
from lathe.generation import RolloutOutput, SamplingParams
from lathe.rollout.agent.loop import AgentLoop, AgentSettings, truncate_text
from lathe.rollout.agent.parser import get_parser
from lathe.rollout.base import to_batch

from rollout.agent.test_render import TOOLS, ids, rendered

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


@dataclass
class Result:
    text: str
    reward: float = 0.0
    error: bool = False
    seconds: float = 0.0


class FakeTools:
    """A ToolSet stand-in: `calculator` evaluates digits-and-operators, after `delay` seconds; with `together`, each
    call waits until that many calls are running at once (a barrier: it breaks, and the call fails, when they never
    all arrive)."""

    def __init__(self, delay: float = 0.0, together: int = 0):
        self.delay, self.opened, self.closed, self.running, self.most = delay, [], [], 0, 0
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(together, timeout=60) if together else None

    def schemas(self):
        return TOOLS

    def open(self, trajectory_id, tools_kwargs):
        self.opened.append((trajectory_id, tools_kwargs))
        tools = self

        class Session:
            def call(self, call, *, timeout_s):
                with tools.lock:
                    tools.running += 1
                    tools.most = max(tools.most, tools.running)
                if tools.barrier is not None:
                    tools.barrier.wait()
                time.sleep(tools.delay)
                with tools.lock:
                    tools.running -= 1
                expr = call.arguments.get("expression", "")
                if call.name != "calculator" or not set(expr) <= set("0123456789+-*"):
                    return Result(f"error: cannot run {call.name}({expr})", error=True)
                return Result(str(eval(expr)), seconds=tools.delay)

            def rewards(self):
                return {"calculator": 1.0}

            def close(self):
                tools.closed.append(trajectory_id)
        return Session()


class ScriptedEngine:
    """LatheEngine's streaming interface, answering request (prefix, sample, turn) with `script[sample][turn]` (its
    tokens plus <|im_end|>), cut at the request's max_tokens; one request finishes per step."""

    def __init__(self, tok, script):
        self.tok, self.script, self.queue, self.done, self.requests = tok, script, [], [], []
        self.eos_ids = [tok.eos_token_id]
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def add_request(self, key, prompts, params, first_index=0):
        assert len(prompts) == 1 and params.n == 1
        self.requests.append((key, list(prompts[0]), params, first_index))
        self.queue.append((key, params))

    def has_unfinished_requests(self):
        return bool(self.queue)

    def step(self):
        key, params = self.queue.pop(0)
        toks = ids(self.tok, self.script[key[1]][key[2]]) + [self.im_end]
        cut = toks[:params.max_tokens]
        self.done.append((key, RolloutOutput([cut], [[-0.5] * len(cut)], ["length" if len(cut) < len(toks) else "stop"])))

    def pop_finished(self):
        out, self.done = self.done, []
        return out


def loop_for(tok, script, tools=None, **settings):
    settings.setdefault("response_length", 400)
    engine = ScriptedEngine(tok, script)
    return engine, AgentLoop(engine, tok, AgentSettings(**settings), tools=tools, parse=get_parser("hermes"))


def prompt_of(tok, text="What is 6*7?"):
    return rendered(tok, [{"role": "user", "content": text}], add_generation_prompt=True)


def test_a_trajectory_is_the_rendered_conversation_and_only_the_models_tokens_are_trained(qwen_tok):
    tok = qwen_tok
    turns = ["Let me compute. " + CALL % "6*7", "It is 42."]
    engine, loop = loop_for(tok, [turns], tools=FakeTools())
    prompt = prompt_of(tok)
    out = loop.generate([prompt], SamplingParams(seed=3), tools_kwargs=[{"calculator": {"create_kwargs": {}}}])
    conversation = [{"role": "user", "content": "What is 6*7?"}, {"role": "assistant", "content": turns[0]},
                    {"role": "tool", "content": "42"}, {"role": "assistant", "content": turns[1]}]
    whole = rendered(tok, conversation)
    response = out.token_ids[0]
    assert prompt + response == whole[:-1]                  # the last "\n" follows the model's final <|im_end|>
    mask = out.loss_masks[0]
    trained = [t for t, m in zip(response, mask) if m]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert trained == ids(tok, turns[0]) + [im_end] + ids(tok, turns[1]) + [im_end]
    first = len(ids(tok, turns[0])) + 1
    assert mask[:first] == [1] * first and mask[-(len(ids(tok, turns[1])) + 1):] == [1] * (len(ids(tok, turns[1])) + 1)
    assert tok.decode([t for t, m in zip(response, mask) if not m]) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert all(lp == 0.0 for lp, m in zip(out.logprobs[0], mask) if not m)
    assert (out.num_turns, out.tool_calls, out.tool_errors, out.finish_reasons) == ([4], [1], [0], ["stop"])
    assert out.tool_rewards == [{"calculator": 1.0}]
    # the second turn was asked with the whole conversation so far, and the budget left
    (_, p0, params0, _), (_, p1, params1, _) = engine.requests
    assert p1 == prompt + response[:len(response) - len(ids(tok, turns[1])) - 1]
    assert params1.max_tokens == 400 - (len(p1) - len(prompt)) and params0.max_tokens == 400
    assert im_end in params0.stop_token_ids and params0.seed == 3 and params1.seed != 3
    batch = to_batch([prompt], out, tok.pad_token_id, 1)
    assert batch["response_mask"][0, :len(mask)].tolist() == mask
    assert batch["attention_mask"][0].sum() == len(prompt) + len(response)


def test_malformed_calls_and_tool_errors_are_answers_the_model_reads(qwen_tok):
    turns = ['<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',
             CALL % "import os", "I give up."]
    engine, loop = loop_for(qwen_tok, [turns], tools=FakeTools())
    out = loop.generate([prompt_of(qwen_tok)], SamplingParams(seed=0))
    text = qwen_tok.decode(out.token_ids[0])
    assert "tool call 1 is not valid JSON" in text and "error: cannot run calculator(import os)" in text
    assert (out.num_turns, out.tool_calls, out.tool_errors) == ([6], [1], [2])


@pytest.mark.parametrize("caps,turns", [(dict(max_assistant_turns=2), 2), (dict(max_user_turns=1), 2),
                                        (dict(), 4)])
def test_turn_caps_end_a_trajectory(qwen_tok, caps, turns):
    script = [[CALL % "1+1"] * 3 + ["done"]]
    engine, loop = loop_for(qwen_tok, script, tools=FakeTools(), **caps)
    out = loop.generate([prompt_of(qwen_tok)], SamplingParams(seed=0))
    assert len(engine.requests) == turns and out.finish_reasons == ["stop"]
    assert out.tool_calls == [min(turns, 3) if not caps else turns - 1]


def test_the_response_budget_covers_all_turns_and_tool_answers(qwen_tok):
    script = [[CALL % "1+1", CALL % "2+2", "done"]]
    first = len(ids(qwen_tok, CALL % "1+1")) + 1
    engine, loop = loop_for(qwen_tok, script, tools=FakeTools(), response_length=first + 80)
    out = loop.generate([prompt_of(qwen_tok)], SamplingParams(seed=0))
    assert out.finish_reasons == ["length"] and len(out.token_ids[0]) <= first + 80
    assert len(engine.requests) == 2 and engine.requests[1][2].max_tokens == first + 80 - (
        len(engine.requests[1][1]) - len(prompt_of(qwen_tok)))
    # no room left for a tool answer: the trajectory ends on the model's turn
    engine, loop = loop_for(qwen_tok, script, tools=FakeTools(), response_length=first + 5)
    out = loop.generate([prompt_of(qwen_tok)], SamplingParams(seed=0))
    assert out.finish_reasons == ["length"] and len(out.token_ids[0]) == first and out.tool_calls == [1]


def test_max_parallel_calls_runs_the_first_calls_of_a_turn(qwen_tok):
    script = [[CALL % "1+1" + CALL % "2+2" + CALL % "3+3", "done"]]
    _, loop = loop_for(qwen_tok, script, tools=FakeTools(), max_parallel_calls=2)
    out = loop.generate([prompt_of(qwen_tok)], SamplingParams(seed=0))
    text = qwen_tok.decode(out.token_ids[0])
    assert "\n2\n" in text and "\n4\n" in text and "\n6\n" not in text and out.tool_calls == [2]


def test_tool_calls_of_all_trajectories_run_at_once_while_others_generate(qwen_tok):
    n = 8
    script = [[CALL % f"{i}+1", f"{i + 1}"] if i % 2 else ["no tool"] for i in range(n)]
    tools = FakeTools(together=n // 2)                             # the four calls return only once all run at once
    engine, loop = loop_for(qwen_tok, script, tools=tools, max_concurrent_tool_calls=16)
    running_at_step = []
    step = engine.step
    engine.step = lambda: running_at_step.append(tools.running) or step()
    out = loop.generate([prompt_of(qwen_tok)] * n, SamplingParams(n=1, seed=0))
    assert not tools.barrier.broken and tools.most == 4 and out.tool_calls == [i % 2 for i in range(n)]
    assert out.tool_errors == [0] * n
    assert any(running_at_step), "the engine generated while tool calls were running"
    assert sorted(tools.closed) == sorted(t for t, _ in tools.opened) and len(tools.opened) == n
    assert all(qwen_tok.decode(t).endswith(f"{i + 1}<|im_end|>") for i, t in enumerate(out.token_ids) if i % 2)


@pytest.mark.parametrize("side,expected", [("left", "abcd...(truncated)"), ("right", "(truncated)...ghij"),
                                           ("middle", "ab...(truncated)...ij")])
def test_long_tool_answers_are_cut_on_the_chosen_side(side, expected):
    assert truncate_text("abcdefghij", 4, side) == expected and truncate_text("abc", 4, side) == "abc"


# -- on lathe's engine ---------------------------------------------------------------------------------------------
def tiny_model(tok):
    """A tiny random Qwen2-shaped lathe decoder over `tok`'s vocabulary (seeded; the global RNG left as it was)."""
    from lathe.models.config import LatheConfig
    from lathe.models.decoder import LatheCausalLM, init_weights
    cfg = LatheConfig(architecture="Qwen2ForCausalLM", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=512, qkv_bias=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LatheCausalLM(cfg)
        init_weights(model, std=0.3)
    return model.eval()


def tiny_engine(tok, **kw):
    return LatheEngine(tiny_model(tok), eos_token_id=tok.eos_token_id, block_size=4, num_kv_blocks=512,
                       max_model_len=512, **kw)


@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(temperature=1.0, seed=11)], ids=["greedy", "seeded"])
def test_with_no_tool_calls_the_loop_samples_what_generate_samples(qwen_tok, sampling):
    engine = tiny_engine(qwen_tok)
    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [prompt_of(qwen_tok, q) for q in ("1+2=", "What is 6*7?", "hi")]
    params = SamplingParams(n=2, max_tokens=24, **sampling)
    loop = AgentLoop(engine, qwen_tok, AgentSettings(response_length=24), tools=FakeTools(), parse=get_parser("hermes"))
    out = loop.generate(prompts, params, first_index=6)
    ref = engine.generate(prompts, SamplingParams(**{**params.__dict__, "stop_token_ids": [im_end]}), first_index=6)
    assert out.token_ids == ref.token_ids and out.finish_reasons == ref.finish_reasons
    assert out.metrics["timing_s/rollout_device_wait"] == ref.metrics["timing_s/rollout_device_wait"] == 0.0   # (CPU)
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5) for a, b in zip(out.logprobs, ref.logprobs))
    a, b = to_batch(prompts, out, qwen_tok.pad_token_id, 2), to_batch(prompts, ref, qwen_tok.pad_token_id, 2)
    for key in ("input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("caching", [True, False])
def test_later_turns_find_the_conversation_in_the_prefix_cache(qwen_tok, caching):
    """Each model turn is one token (every printable character stops it) and "calls" the tool (the parser says so):
    a turn's prompt is the previous turn's plus a tool answer, and its prefill finds the previous turn's full KV
    blocks in the cache."""
    engine = tiny_engine(qwen_tok, enable_prefix_caching=caching)
    loop = AgentLoop(engine, qwen_tok, AgentSettings(response_length=200), tools=FakeTools(),
                     parse=lambda text: get_parser("hermes")(CALL % "6*7"))
    out = loop.generate([prompt_of(qwen_tok)], SamplingParams(seed=0, stop_token_ids=list(range(7, 107))))
    assert out.tool_calls[0] >= 2 and out.finish_reasons == ["length"]
    rate = out.metrics["agent/prefix_hit_rate"]
    assert rate > 0.4 if caching else rate == 0


def test_later_turns_on_a_hybrid_model_continue_their_parked_turn(qwen_tok):
    """Qwen3.5 (linear-attention layers: no prefix cache): each turn's prompt continues the finished turn, whose KV
    and states the engine kept (parked): later turns compute only the tool answer and after, and sample what an
    engine computing each whole conversation again samples."""
    import copy

    from transformers import AutoModelForCausalLM

    from lathe.models.hf import lathe_from_transformers
    from models.lathe_tiny import hybrid_config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = lathe_from_transformers(AutoModelForCausalLM.from_config(hybrid_config(
            "qwen3_5_text", vocab_size=len(qwen_tok), max_position_embeddings=512))).eval()
    outs = {}
    for park in (False, True):
        engine = LatheEngine(copy.deepcopy(model), eos_token_id=qwen_tok.eos_token_id, block_size=4,
                             num_kv_blocks=512, max_model_len=512)
        engine.park_finished = park
        loop = AgentLoop(engine, qwen_tok, AgentSettings(response_length=60), tools=FakeTools(),
                         parse=lambda text: get_parser("hermes")(CALL % "6*7"))
        outs[park] = loop.generate([prompt_of(qwen_tok)] * 2, SamplingParams(seed=0, temperature=1.0,
                                                                           stop_token_ids=list(range(7, 107))))
    assert min(outs[True].tool_calls) >= 2 and outs[True].token_ids == outs[False].token_ids
    assert outs[False].metrics["agent/prefix_hit_rate"] == 0 and outs[True].metrics["agent/prefix_hit_rate"] > 0.4


def test_prefill_batching_changes_when_turns_start_not_what_they_sample(qwen_tok):
    """The agent loop sets the engine's prefill interval for its call (and restores it); the samples are the same
    (up to the last bits of batch-dependent logits, which a batch of another size may round differently and so flip
    a sample now and then: all but two of the 32 trajectories must match)."""
    outs = []
    for interval in (1, 8):
        engine = tiny_engine(qwen_tok)
        loop = AgentLoop(engine, qwen_tok, AgentSettings(response_length=120, max_assistant_turns=3,
                                                          prefill_interval=interval), tools=FakeTools(),
                         parse=lambda text: get_parser("hermes")(CALL % "6*7"))
        stops = list(range(7, 107, 3))                          # turns of a few tokens
        outs.append(loop.generate([prompt_of(qwen_tok, q) for q in ("a", "bb", "ccc", "dddd")],
                                  SamplingParams(n=8, seed=5, stop_token_ids=stops)))
        assert engine.scheduler.prefill_interval == 1          # restored after the call
    same = sum(a == b for a, b in zip(outs[0].token_ids, outs[1].token_ids))
    assert same >= len(outs[0].token_ids) - 2, f"{same} of {len(outs[0].token_ids)} trajectories equal"


@pytest.mark.parametrize("interval,waiting,held", [(1, 1, 0), (8, 1, 6), (8, 4, 0)])
def test_the_scheduler_holds_a_few_arrivals_for_the_interval(qwen_tok, interval, waiting, held):
    """With 16 sequences decoding, `waiting` new requests arriving one decode step after the last prefill are
    prefilled after `held` more decode steps: at once without batching; for one arrival, once interval - 1 decode
    steps have passed since the last prefill; at once when a quarter of the batch waits."""
    engine = tiny_engine(qwen_tok)
    engine.scheduler.prefill_interval = interval
    long = SamplingParams(n=16, seed=0, max_tokens=40, ignore_eos=True)
    engine.add_request("running", [prompt_of(qwen_tok, "a")], long)
    while engine.scheduler.waiting or engine.scheduler.prefilling is not None:
        engine.step()
    engine.step()                                               # one decode step since the prefill
    engine.add_request("new", [prompt_of(qwen_tok, "b")], replace(long, n=waiting))
    decodes = engine.scheduler.num_steps["decode"]
    while engine.scheduler.waiting:
        engine.step()
    assert engine.scheduler.num_steps["decode"] - decodes == held


def test_the_loop_over_a_speculative_engine_gives_the_plain_engines_greedy_turns(qwen_tok):
    """The agent loop streams its turns into an engine decoding speculatively (a tiny MiMo's MTP layer drafting):
    the greedy trajectories and log-probs of the plain engine, and the acceptance metrics in the output."""
    from dataclasses import replace as with_fields
    from lathe.models.decoder import LatheCausalLM, init_weights
    base = tiny_model(qwen_tok)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = LatheCausalLM(with_fields(base.config, architecture="MiMoForCausalLM", num_mtp_layers=1))
        init_weights(model, std=0.3)
    model.load_state_dict(base.state_dict(), strict=False)       # the main model's weights; the MTP layer random
    prompts = [prompt_of(qwen_tok, q) for q in ("1+2=", "What is 6*7?", "hi")]
    params = SamplingParams(n=2, max_tokens=24, do_sample=False)
    outs = []
    for k in (0, 2):
        engine = LatheEngine(model.eval(), eos_token_id=qwen_tok.eos_token_id, block_size=4, num_kv_blocks=512,
                             max_model_len=512, num_speculative_tokens=k)
        loop = AgentLoop(engine, qwen_tok, AgentSettings(response_length=24), tools=FakeTools(),
                         parse=get_parser("hermes"))
        outs.append(loop.generate(prompts, params))
    plain, spec = outs
    assert spec.token_ids == plain.token_ids and spec.finish_reasons == plain.finish_reasons
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5) for a, b in zip(spec.logprobs, plain.logprobs))
    assert "rollout/spec_accept_rate" in spec.metrics and "rollout/spec_accept_rate" not in plain.metrics


@pytest.mark.parametrize("caching", [True, False])
def test_r3_each_trajectory_s_routing_is_stitched_from_its_turns(qwen_tok, caching):
    """Routing replay R3 in the agent loop (a tiny Qwen3-MoE recording its choices): a trajectory's routing covers
    every token its turns fed the engine (the prompt, each turn's response, the tool answers), as a teacher-forced
    forward of the whole trajectory routes them, whether a later turn found the conversation in the prefix cache or
    computed it again; its last token, never fed, is -1. `to_batch` lays it out as `input_ids`."""
    from lathe.models.config import LatheConfig, MoeConfig
    from lathe.models.decoder import LatheCausalLM, init_weights
    from lathe.models.routing import record_routing
    from lathe.rollout.base import ROUTED
    cfg = LatheConfig(architecture="Qwen3MoeForCausalLM", vocab_size=len(qwen_tok), hidden_size=32,
                      intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=512, qk_norm=True,
                      moe=MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                    norm_topk_prob=True))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LatheCausalLM(cfg)
        init_weights(model, std=0.3)
    model.eval()
    engine = LatheEngine(model, eos_token_id=qwen_tok.eos_token_id, block_size=4, num_kv_blocks=512,
                         max_model_len=512, record_routing=True, enable_prefix_caching=caching)
    loop = AgentLoop(engine, qwen_tok, AgentSettings(response_length=60), tools=FakeTools(),
                     parse=lambda text: get_parser("hermes")(CALL % "6*7"))
    prompts = [prompt_of(qwen_tok), prompt_of(qwen_tok, "hi")]
    out = loop.generate(prompts, SamplingParams(seed=0, temperature=1.0, stop_token_ids=list(range(7, 107))))
    assert min(out.tool_calls) >= 2
    for prompt, resp, rec in zip(prompts, out.token_ids, out.routed_experts):
        ids = prompt + resp
        assert rec.dtype == torch.int16 and rec.shape == (len(ids), 2, 2)
        assert (rec[-1] == -1).all() and (rec[:-1] >= 0).all()
        with torch.no_grad(), record_routing(model) as forward:
            model(torch.tensor([ids]))
        want = torch.stack([layer[0] for layer in forward], dim=1)[:-1]
        assert torch.equal(rec[:-1].sort(-1).values.long(), want.sort(-1).values.long())
    batch = to_batch(prompts, out, qwen_tok.pad_token_id, 1)
    assert batch[ROUTED].shape[:2] == batch["input_ids"].shape
