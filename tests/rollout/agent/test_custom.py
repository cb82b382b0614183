"""`lathe.rollout.agent.custom`: verl's custom agent loops on lathe's engine. The built-in `single_turn_agent` samples
exactly what single-turn generation samples; a two-turn loop written as a verl user writes one (imported by its
`_target_` from the working directory) gets the row's fields, its turns' tokens as the engine sampled them, the tool
answer as the chat template renders it, and its log-probs taken from its calls when it returns none; a failing,
hanging or malformed loop stops the call with its name and sample, leaving the engine empty."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from lathe.batch import Batch
from lathe.generation import SamplingParams
from lathe.rollout.agent import AGENT_SCORE, agent_columns, agent_kwargs
from lathe.rollout.agent.custom import AgentLoopError, CustomAgentLoops, load_registry
from lathe.rollout.base import to_batch

from rollout.agent.test_loop import prompt_of, tiny_engine
from rollout.agent.test_render import ids

LOOPS = '''
from lathe.rollout.agent.custom import AgentLoopBase, AgentLoopOutput, register

SEEN = []


class TwoTurns(AgentLoopBase):
    """A turn of 3 tokens, a tool answer, a turn of 3 tokens; no log-probs returned (taken from the calls)."""

    def __init__(self, *args, hint="42", **kwargs):
        super().__init__(*args, **kwargs)
        self.hint = hint

    async def run(self, sampling_params, **kwargs):
        SEEN.append(kwargs)
        messages = list(kwargs["raw_prompt"])
        prompt = await self.ct_build_initial_tokens(messages)
        params = {**sampling_params, "max_tokens": 3}
        first = await self.server_manager.generate(request_id="r", prompt_ids=prompt, sampling_params=params)
        ids, mask, lp = await self.ct_merge_assistant_token(prompt, first.token_ids, [], [], first.log_probs)
        said = messages + [{"role": "assistant", "content": "x"}]
        ids, mask, lp = await self.ct_merge_non_assistant_msg(said, said + [{"role": "tool", "content": self.hint}],
                                                              ids.token_ids, mask, lp)
        SEEN.append({"second_prompt": list(ids.token_ids), "first": list(first.token_ids)})
        second = await self.server_manager.generate(request_id="r", prompt_ids=ids.token_ids, sampling_params=params)
        ids, mask, lp = await self.ct_merge_assistant_token(ids.token_ids, second.token_ids, mask, lp,
                                                            second.log_probs)
        n = self.rollout_config.response_length
        return AgentLoopOutput(prompt_ids=prompt, response_ids=ids.token_ids[len(prompt):][:n], response_mask=mask[:n],
                               reward_score=float(kwargs["index"]), num_turns=4, extra_fields={"hint": self.hint},
                               metrics={"generate_sequences": 0.5})


class Raises(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        await self.server_manager.generate(prompt_ids=kwargs["prompt_ids"], sampling_params={"max_tokens": 8})
        raise KeyError("no such column")


class Hangs(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        import asyncio
        await asyncio.sleep(60)


class BadMask(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        out = await self.server_manager.generate(prompt_ids=kwargs["prompt_ids"], sampling_params={})
        return AgentLoopOutput(prompt_ids=kwargs["prompt_ids"], response_ids=out.token_ids, response_mask=[1],
                               metrics={})


@register("registered_here")
class Registered(AgentLoopBase):
    """Registered by the decorator as the YAML file's module is imported (the file does not list it)."""


class Retokenised(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        out = await self.server_manager.generate(prompt_ids=kwargs["prompt_ids"], sampling_params={"max_tokens": 4})
        ids = [t + 1 for t in out.token_ids]
        return AgentLoopOutput(prompt_ids=kwargs["prompt_ids"], response_ids=ids, response_mask=[1] * len(ids),
                               metrics={})
'''


@pytest.fixture
def loops(tmp_path, monkeypatch):
    """The loops module in a fresh working directory, listed in a YAML file; the registry loaded from it."""
    (tmp_path / "my_loops.py").write_text(LOOPS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ["TwoTurns", "Raises", "Hangs", "BadMask", "Retokenised"]
    yaml = "".join(f"- name: {n.lower()}\n  _target_: my_loops.{n}\n" for n in names) + "  # (kwargs below)\n"
    yaml = yaml.replace("my_loops.TwoTurns\n", "my_loops.TwoTurns\n  hint: '7'\n")
    (tmp_path / "loops.yaml").write_text(yaml)
    yield load_registry(str(tmp_path / "loops.yaml"))
    sys.modules.pop("my_loops", None)


def run_cfg(response_length=24):
    from lathe.config.loader import load_config
    return load_config(None, [f"data.max_response_length={response_length}", "data.max_prompt_length=512"])


def runner(tok, registry, *, default="single_turn_agent", timeout_s=30.0, response_length=24):
    engine = tiny_engine(tok)
    return engine, CustomAgentLoops(engine, tok, run_cfg(response_length), registry=registry, default=default,
                                    response_length=response_length, prompt_length=512, timeout_s=timeout_s)


def rows_of(tok, questions, agent_name=None):
    return [{"raw_prompt": [{"role": "user", "content": q}], "data_source": "t", "extra_info": {"k": i},
             "index": i, "agent_name": agent_name, "reward_model": {"ground_truth": str(i)}}
            for i, q in enumerate(questions)]


@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(temperature=1.0, seed=11)], ids=["greedy", "seeded"])
def test_single_turn_agent_samples_what_generate_samples(qwen_tok, sampling):
    engine, run = runner(qwen_tok, load_registry(None))
    questions = ("1+2=", "What is 6*7?", "hi")
    prompts = [prompt_of(qwen_tok, q) for q in questions]
    params = SamplingParams(n=2, max_tokens=24, **sampling)
    out = run.generate(prompts, params, first_index=6, rows=rows_of(qwen_tok, questions))
    ref = engine.generate(prompts, params, first_index=6)
    assert out.token_ids == ref.token_ids and out.finish_reasons == ref.finish_reasons
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5) for a, b in zip(out.logprobs, ref.logprobs))
    assert out.prompt_ids == [p for p in prompts for _ in range(2)] and out.loss_masks == [[1] * len(r) for r in
                                                                                          ref.token_ids]
    a, b = to_batch(prompts, out, qwen_tok.pad_token_id, 2), to_batch(prompts, ref, qwen_tok.pad_token_id, 2)
    for key in ("input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(a[key], b[key]), key
    assert not engine.has_unfinished_requests()


def test_a_two_turn_loop_gets_its_row_its_turns_and_the_rendered_tool_answer(qwen_tok, loops):
    import my_loops
    from lathe.rollout.agent.render import ConversationRenderer
    engine, run = runner(qwen_tok, loops, default="twoturns")
    questions = ("1+2=", "hi")
    prompts = [prompt_of(qwen_tok, q) for q in questions]
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24)
    out = run.generate(prompts, params, first_index=0, rows=rows_of(qwen_tok, questions))
    rows = [s for s in my_loops.SEEN if "raw_prompt" in s]
    assert [r["index"] for r in rows] == [0, 0, 1, 1] and rows[2]["extra_info"] == {"k": 1}
    assert rows[0]["reward_model"] == {"ground_truth": "0"} and rows[0]["prompt_ids"] == prompts[0]
    turns = [s for s in my_loops.SEEN if "first" in s]
    delta = ConversationRenderer(qwen_tok).messages_delta([{"role": "tool", "content": "7"}])   # (the YAML's hint)
    for sample, turn in zip(range(4), turns):                      # (one loop's turns, in the order they ran)
        assert turn["second_prompt"][-len(delta):] == delta
    for i in range(4):
        response, mask, logprobs = out.token_ids[i], out.loss_masks[i], out.logprobs[i]
        first = response[:mask.index(0)]
        own = ids(qwen_tok, qwen_tok.apply_chat_template([{"role": "user", "content": questions[i // 2]}],
                                                         tokenize=False, add_generation_prompt=True))
        assert 1 <= len(first) <= 3 and mask.count(1) <= 6 and out.prompt_ids[i] == own != prompts[i // 2]
        assert all(lp < 0 for lp, m in zip(logprobs, mask) if m) and all(lp == 0 for lp, m in zip(logprobs, mask)
                                                                         if not m)
    assert out.reward_scores == [0.0, 0.0, 1.0, 1.0] and out.extra_fields == [{"hint": "7"}] * 4
    assert out.num_turns == [4] * 4 and out.metrics["timing_s/agent_loop/generate_sequences/mean"] == 0.5
    again = runner(qwen_tok, loops, default="twoturns")[1].generate(prompts, params, rows=rows_of(qwen_tok, questions))
    assert again.token_ids == out.token_ids                        # every turn seeded by (seed, sample, turn)
    batch = Batch(non_tensors={"extra_info": [{"k": i // 2} for i in range(4)]})
    columns = agent_columns(out, batch["extra_info"])
    assert list(columns[AGENT_SCORE]) == [0.0, 0.0, 1.0, 1.0] and columns["extra_info"][3]["hint"] == "7"


@pytest.mark.parametrize("name, match", [
    ("raises", r"agent loop 'raises' \(my_loops.Raises\) failed on sample [01] \(prompt 0\): KeyError"),
    ("badmask", r"response_mask has 1 values for \d+ response tokens"),
    ("retokenised", r"no response_logprobs, and its model tokens .* are not its generate calls' tokens"),
])
def test_a_failing_or_malformed_loop_stops_the_call_naming_it_and_leaves_the_engine_empty(qwen_tok, loops, name,
                                                                                          match):
    engine, run = runner(qwen_tok, loops, default=name)
    with pytest.raises(AgentLoopError, match=match):
        run.generate([prompt_of(qwen_tok)], SamplingParams(n=2, max_tokens=8), rows=rows_of(qwen_tok, ["q"]))
    assert not engine.has_unfinished_requests() and not engine.pop_finished()


def test_a_hanging_loop_is_stopped_after_the_timeout(qwen_tok, loops):
    engine, run = runner(qwen_tok, loops, default="hangs", timeout_s=0.3)
    with pytest.raises(AgentLoopError, match=r"samples \[0\] neither generated nor finished for 0 s"):
        run.generate([prompt_of(qwen_tok)], SamplingParams(n=1, max_tokens=8), rows=rows_of(qwen_tok, ["q"]))


def test_rows_pick_their_loop_and_an_unknown_one_is_named(qwen_tok, loops):
    assert loops["registered_here"][0].__name__ == "Registered" and loops["twoturns"][1] == {"hint": "7"}
    engine, run = runner(qwen_tok, loops)
    rows = rows_of(qwen_tok, ["a", "b"])
    rows[1]["agent_name"] = "twoturns"
    out = run.generate([prompt_of(qwen_tok, "a"), prompt_of(qwen_tok, "b")], SamplingParams(max_tokens=6), rows=rows)
    assert out.num_turns == [2, 4]
    rows[0]["agent_name"] = "nope"
    with pytest.raises(AgentLoopError, match=r"prompt 0: agent_name='nope' names no agent loop \(loops: \['badmask'"):
        run.generate([prompt_of(qwen_tok, "a")], SamplingParams(max_tokens=6), rows=rows[:1])


def test_unknown_sampling_arguments_and_images_are_refused(qwen_tok, loops):
    from lathe.rollout.agent.custom import ServerManager, _Call, _Sample
    engine, run = runner(qwen_tok, loops)
    call = _Call("x", SamplingParams(), 0, 0)
    manager = ServerManager(run, _Sample(0, {}, "single_turn_agent", call))
    for kwargs, match in ((dict(sampling_params={"frequency_penalty": 0.5}), r"\['frequency_penalty'\] are not"),
                          (dict(sampling_params={"repetition_penalty": 1.1}), "repetition_penalty=1.1"),
                          (dict(sampling_params={}, image_data=["img"]), "not implemented yet in lathe")):
        with pytest.raises(AgentLoopError, match=match):
            asyncio.run(manager.generate(prompt_ids=[1, 2], **kwargs))
    sample = _Sample(0, {}, "single_turn_agent", call)
    assert run._sampling(sample, [1], {"seed": 7}).seed == 7 and run._sampling(sample, [1], {}).seed == 0
    sample.calls = 1                                    # a later call: the seed mixed with the call's number
    assert run._sampling(sample, [1], {"seed": 7}).seed not in (7, run._sampling(sample, [1], {}).seed)
    got = run._sampling(sample, [1], {"temperature": 0, "max_new_tokens": 5, "stop": "x", "stop_token_ids": [3]})
    assert got.greedy and got.max_tokens == 5 and got.stop == ["x"] and 3 in got.stop_token_ids


def test_loading_names_what_is_wrong_with_the_file_or_the_class(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "uses_verl.py").write_text("from verl.experimental.agent_loop import AgentLoopBase\n")
    (tmp_path / "not_a_loop.py").write_text("class Plain:\n    pass\n")
    for body, match in (("- name: a\n  _target_: uses_verl.X\n", "imports verl .* from lathe.rollout.agent.custom"),
                        ("- name: a\n  _target_: not_a_loop.Plain\n", "not a subclass of lathe's AgentLoopBase"),
                        ("- name: a\n  _target_: not_a_loop.Missing\n", "has no 'Missing'"),
                        ("name: a\n", "expected a non-empty YAML list"),
                        ("- name: a\n", "a string 'name' and '_target_'")):
        (tmp_path / "l.yaml").write_text(body)
        with pytest.raises(AgentLoopError, match=match):
            load_registry(str(tmp_path / "l.yaml"))
    for name in ("uses_verl", "not_a_loop"):
        sys.modules.pop(name, None)


def test_agent_kwargs_gives_a_custom_runner_the_rows(qwen_tok):
    prompts = Batch(non_tensors={"raw_prompt": [[{"role": "user", "content": "a"}]], "data_source": ["d"],
                                 "ground_truth": ["3"], "extra_info": [{"tools_kwargs": {"t": {}}}], "index": [4],
                                 "uid": ["1:0:0"]})
    assert "rows" not in agent_kwargs(prompts)
    row = agent_kwargs(prompts, CustomAgentLoops)["rows"][0]
    assert row["reward_model"] == {"ground_truth": "3", "style": "rule"} and row["tools_kwargs"] == {"t": {}}
    assert row["index"] == 4 and row["uid"] == "1:0:0" and row["interaction_kwargs"] == {}


def test_to_batch_lays_out_each_samples_own_prompt():
    from lathe.rollout.agent.loop import AgentOutput
    out = AgentOutput(token_ids=[[5, 6], [7]], logprobs=[[-1.0, -1.0], [-1.0]], finish_reasons=["stop"] * 2,
                      loss_masks=[[1, 1], [1]], prompt_ids=[[1, 2, 3], [9]])
    b = to_batch([[1, 2, 3]], out, 0, 2)
    assert b["input_ids"].tolist() == [[1, 2, 3, 5, 6], [0, 0, 9, 7, 0]]
    assert b["position_ids"].tolist()[1][2:4] == [0, 1]


def test_a_loop_busy_with_its_own_work_longer_than_the_timeout_is_not_stopped_while_it_progresses(qwen_tok, tmp_path,
                                                                                                monkeypatch):
    """The limit is on a stretch with no progress (no turn asked for, no loop finished), not on a loop's total."""
    (tmp_path / "slow_loops.py").write_text(
        "import asyncio\n"
        "from lathe.rollout.agent.custom import AgentLoopBase, AgentLoopOutput\n\n\n"
        "class Slow(AgentLoopBase):\n"
        "    async def run(self, sampling_params, **kwargs):\n"
        "        ids = []\n"
        "        for _ in range(3):\n"
        "            await asyncio.sleep(0.2)\n"
        "            out = await self.server_manager.generate(prompt_ids=kwargs['prompt_ids'] + ids,\n"
        "                                                     sampling_params={'max_tokens': 1})\n"
        "            ids += out.token_ids\n"
        "        return AgentLoopOutput(prompt_ids=kwargs['prompt_ids'], response_ids=ids, response_mask=[1] * 3,\n"
        "                               metrics={})\n")
    (tmp_path / "l.yaml").write_text("- name: slow\n  _target_: slow_loops.Slow\n")
    monkeypatch.chdir(tmp_path)
    try:
        engine, run = runner(qwen_tok, load_registry(str(tmp_path / "l.yaml")), default="slow", timeout_s=0.35)
        out = run.generate([prompt_of(qwen_tok)], SamplingParams(max_tokens=8), rows=rows_of(qwen_tok, ["q"]))
    finally:
        sys.modules.pop("slow_loops", None)
    assert len(out.token_ids[0]) == 3 and all(lp < 0 for lp in out.logprobs[0])


def test_verls_helpers_a_loop_uses(qwen_tok):
    """`apply_chat_template(remove_system_prompt=True)` drops the template's default system prompt (a tool message
    rendered for appending), `simple_timer` times a block, `rollout_trace_op` leaves the function as it is."""
    from lathe.rollout.agent.custom import AgentLoopBase, rollout_trace_op, simple_timer
    engine, run = runner(qwen_tok, load_registry(None))
    from lathe.rollout.agent.custom import ConfigView, DictConfigWrap, ServerManager, _Sample

    async def render():
        loop = AgentLoopBase(DictConfigWrap(ConfigView(run.cfg)), ServerManager(run, _Sample(0, {}, "x")), qwen_tok)
        tool = [{"role": "tool", "content": "42"}]
        return (await loop.apply_chat_template(tool), await loop.apply_chat_template(tool, remove_system_prompt=True),
                loop._system_prefix(None))

    whole, cut, system = asyncio.run(render())
    assert system and whole == system + cut and "system" in qwen_tok.decode(system) and "42" in qwen_tok.decode(cut)
    timing = {}
    with simple_timer("generate_sequences", timing):
        pass
    assert timing["generate_sequences"] >= 0 and rollout_trace_op(len) is len


def test_rows_naming_a_loop_this_run_does_not_have_are_refused_naming_the_fix():
    """verl's `agent_name` column without custom loops: `tool_agent` runs on the tool loop only, any other name is
    a custom loop's; `single_turn_agent` and null run anywhere."""
    from types import SimpleNamespace

    from lathe.rollout.agent import check_agent_names

    def rollout_cfg(tools=False, custom=None):
        return SimpleNamespace(multi_turn=SimpleNamespace(enable=tools), agent={"agent_loop_config_path": custom})

    def rows(*names):
        return Batch(non_tensors={"agent_name": list(names), "index": list(range(10, 10 + len(names)))})

    check_agent_names(rows(None, "single_turn_agent"), rollout_cfg())
    check_agent_names(rows("tool_agent", None), rollout_cfg(tools=True))
    check_agent_names(rows("anything"), rollout_cfg(custom="loops.yaml"))       # (the custom runner checks it)
    with pytest.raises(ValueError, match=r"prompt 11: agent_name='tool_agent' .*single-turn generation.*"
                                         r"multi_turn.enable=true"):
        check_agent_names(rows(None, "tool_agent"), rollout_cfg())
    with pytest.raises(ValueError, match=r"prompt 10: agent_name='math' .*the tool loop.*agent_loop_config_path"):
        check_agent_names(rows("math"), rollout_cfg(tools=True))


def test_merging_messages_twice_after_a_turn_is_refused(qwen_tok):
    """After a tool answer the generation prompt is already appended: a second merge would repeat it."""
    from lathe.rollout.agent.custom import AgentLoopBase, ConfigView, DictConfigWrap, ServerManager, _Sample
    engine, run = runner(qwen_tok, load_registry(None))

    async def twice():
        loop = AgentLoopBase(DictConfigWrap(ConfigView(run.cfg)), ServerManager(run, _Sample(0, {}, "x")), qwen_tok)
        said = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        tool = said + [{"role": "tool", "content": "1"}]
        ids, mask, _ = await loop.ct_merge_non_assistant_msg(said, tool, [5, 6], [1])
        await loop.ct_merge_non_assistant_msg(tool, tool + [{"role": "user", "content": "more"}], ids.token_ids, mask)

    with pytest.raises(AgentLoopError, match="previous_messages must end with the model's turn"):
        asyncio.run(twice())


def test_the_examples_self_check_loop_asks_again_when_the_answer_has_no_final_line(qwen_tok, monkeypatch):
    """examples/agents/self_check.py (examples/gsm8k_custom_agent.sh) loaded from its YAML file as the script loads
    it: the tiny random model never writes "####", so each sample is a turn, the reminder (mask 0, as the chat template
    renders it after the turn), and a second turn; with "####" in a turn's text, one turn."""
    from pathlib import Path
    from lathe.rollout.agent.render import ConversationRenderer
    agents = Path(__file__).resolve().parents[3] / "examples" / "agents"
    monkeypatch.syspath_prepend(str(agents))
    registry = load_registry(str(agents / "loops.yaml"))
    import self_check
    engine, run = runner(qwen_tok, registry, default="self_check", response_length=250)
    out = run.generate([prompt_of(qwen_tok, "What is 6*7?")], SamplingParams(n=1, temperature=1.0, seed=3,
                                                                            max_tokens=250),
                       rows=[{"raw_prompt": [{"role": "user", "content": "What is 6*7?"}], "uid": "u"}])
    renderer = ConversationRenderer(qwen_tok)
    delta = renderer.messages_delta([{"role": "user", "content": self_check.REMINDER}])
    for tokens, mask in zip(out.token_ids, out.loss_masks):
        first = mask.index(0)
        added = renderer.close_turn(tokens[first - 1:first]) + delta       # (the turn's end marker, the reminder)
        assert mask[first:first + len(added)] == [0] * len(added) and 1 in mask[first + len(added):]
        assert tokens[first:first + len(added)] == added
    assert out.num_turns == [4]
    monkeypatch.setattr(qwen_tok, "decode", lambda *a, **k: "#### 42")      # an answer with its final line
    once = runner(qwen_tok, registry, default="self_check", response_length=250)[1].generate(
        [prompt_of(qwen_tok)], SamplingParams(n=1, max_tokens=250), rows=[{"raw_prompt": [{"role": "user",
                                                                                          "content": "q"}]}])
    assert once.num_turns == [2] and 0 not in once.loss_masks[0]
    sys.modules.pop("self_check", None)


def test_a_stream_of_requests_samples_what_generate_samples(qwen_tok, loops):
    """`CustomStream` (a fully-async replica's): two requests added while the engine runs, their loops in a thread of
    their own, the engine stepped by this one: each request's samples are what one `generate` call samples."""
    import threading
    from lathe.rollout.agent.custom import CustomStream
    questions = ("1+2=", "hi")
    prompts = [prompt_of(qwen_tok, q) for q in questions]
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24)
    want = [runner(qwen_tok, loops, default="twoturns")[1].generate([p], params, first_index=2 * i,
                                                                     rows=rows_of(qwen_tok, [q]))
            for i, (p, q) in enumerate(zip(prompts, questions))]
    engine, run = runner(qwen_tok, loops, default="twoturns")
    woken = threading.Event()
    stream = CustomStream(run, woken.set)
    done = {}
    try:
        for i, (p, q) in enumerate(zip(prompts, questions)):
            stream.add(f"r{i}", [p], params, first_index=2 * i, agent={"rows": rows_of(qwen_tok, [q])})
            for _ in range(3):                          # (the second request arrives mid-way through the first)
                done.update(stream.advance())
                if engine.has_unfinished_requests():
                    engine.step()
                done.update(stream.on_finished(engine.pop_finished()))
        while stream.busy():
            if not (stream.ready() or engine.has_unfinished_requests()):
                assert woken.wait(timeout=30), "the loops neither queued a turn nor finished"
            woken.clear()
            done.update(stream.advance())
            if engine.has_unfinished_requests():
                engine.step()
            done.update(stream.on_finished(engine.pop_finished()))
    finally:
        stream.close()
    assert sorted(done) == ["r0", "r1"]
    for i in range(2):
        assert done[f"r{i}"].token_ids == want[i].token_ids and done[f"r{i}"].loss_masks == want[i].loss_masks
        assert done[f"r{i}"].versions == [[(0, 0)]] * 2


def test_each_token_keeps_the_version_that_sampled_it():
    """Model tokens take their call's versions; appended ones the token before's; a retokenised response the oldest
    version of its calls throughout."""
    from lathe.rollout.agent.custom import _aligned_versions
    generated = [([5, 6], [-1.0, -1.0], [3, 4]), ([7], [-1.0], [5])]
    assert _aligned_versions([5, 6, 9, 9, 7], [1, 1, 0, 0, 1], generated) == [3, 4, 4, 4, 5]
    assert _aligned_versions([5, 8], [1, 1], generated) == [3, 3]
    assert _aligned_versions([9, 5], [0, 1], generated) == [3, 3]


def test_a_stream_whose_loop_hangs_raises_in_the_engines_thread(qwen_tok, loops):
    import threading
    from lathe.rollout.agent.custom import CustomStream
    engine, run = runner(qwen_tok, loops, default="hangs", timeout_s=0.5)
    woken = threading.Event()
    stream = CustomStream(run, woken.set)
    try:
        stream.add("r", [prompt_of(qwen_tok)], SamplingParams(max_tokens=8), first_index=0,
                   agent={"rows": rows_of(qwen_tok, ["q"])})
        assert woken.wait(timeout=10) and stream.ready()
        with pytest.raises(AgentLoopError, match=r"1 request\(s\) neither generated nor finished for 0 s"):
            stream.advance()
    finally:
        stream.close()
