"""A generative reward model (`reward_model.judge.enable`): the judge prompt, the verdict parser, the judge's engine
against transformers' `generate`, two steps of `lathe train` scored by the judge, and the configs refused."""

from __future__ import annotations

import json
import re
from contextlib import contextmanager

import pytest
import torch

from lathe.config import ConfigError, load_config
from lathe.loop.ppo import fit
from lathe.loop.preflight import preflight
from lathe.loop.setup import build_trainer
from lathe.reward.judge import VerdictSpec, combine_scores, parse_verdict, question_of, render_prompt
from lathe.workers.judge import JudgeWorker

RUN = ["data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
       "data.max_response_length=4", "actor_rollout_ref.model.warm_start.steps=0", "trainer.total_training_steps=2",
       "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[console]"]
TEMPLATE = "Q: {question} A: {response} Truth: {ground_truth}. Score 0-99, \\boxed{} kept:"


def tiny_judge(path, *, vocab_extra: int = 0, chat_template: bool = True, seed: int = 0) -> str:
    """A tiny random `LlamaForCausalLM` with the built-in tokenizer saved in `path` (`vocab_extra` tokens added to
    the tokenizer only: ids the model cannot read)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lathe.data.builtin import builtin_tokenizer
    tok = builtin_tokenizer()
    rows = len(tok)
    if vocab_extra:
        tok.add_tokens([f"<extra{i}>" for i in range(vocab_extra)])
    if not chat_template:
        tok.chat_template = None
    torch.manual_seed(seed)
    digits = tok.convert_tokens_to_ids(list("0123456789"))
    config = LlamaConfig(vocab_size=rows, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():                  # digits likelier: greedy verdicts that parse (which digit: the input's)
        model.lm_head.weight[digits] *= 2
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def judge_overrides(path, *extra: str) -> list[str]:
    return ["reward_model.enable=true", f"reward_model.model.path={path}", "reward_model.judge.enable=true",
            f"reward_model.judge.prompt_template='{TEMPLATE}'", "reward_model.judge.score_range=[0,99]",
            "reward_model.rollout.do_sample=false", "reward_model.rollout.response_length=3",
            "reward_model.rollout.prompt_length=200", *extra]


@contextmanager
def trainer_closed(trainer):
    try:
        yield trainer
    finally:
        trainer.close()


# -- text side ---------------------------------------------------------------------------------------------------
def test_template_renders_the_three_fields_and_nothing_else():
    text = render_prompt("Q={question} R={response} G={ground_truth} {other} \\boxed{}", question="1+1?",
                         response="it is {question} 2", ground_truth=2)
    assert text == "Q=1+1? R=it is {question} 2 G=2 {other} \\boxed{}"
    assert render_prompt("{response}|{ground_truth}", question="", response="x", ground_truth=None) == "x|"
    assert question_of([{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                        {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]) == "c"
    assert question_of("plain") == "plain"


NUMBERS, LABELS = VerdictSpec("score", 0, 10), {"yes": 1.0, "no": 0.0, "partly": 0.5}


@pytest.mark.parametrize("text, spec, expected", [
    ("The answer is fine. 7", NUMBERS, 0.7),
    ("3 issues; overall 10", NUMBERS, 1.0),
    ("score: 2.5", NUMBERS, 0.25),
    ("rating -1", NUMBERS, None),                                  # outside the range: a failure
    ("11", NUMBERS, None),
    ("no number here", NUMBERS, None),
    ("", NUMBERS, None),
    ("so \\boxed{4} but 9", VerdictSpec("boxed", 0, 10), 0.4),     # the box, not the last number
    ("\\boxed{1} then \\boxed{ 8 }", VerdictSpec("boxed", 0, 10), 0.8),
    ("\\boxed{Yes}", VerdictSpec("boxed", 0, 10, LABELS), 1.0),
    ("\\boxed{maybe}", VerdictSpec("boxed", 0, 10, LABELS), None),
    ("\\boxed{4", VerdictSpec("boxed", 0, 10), None),              # the brace never closes
    ("7 but no box", VerdictSpec("boxed", 0, 10), None),
    ("Yes, at first; on reflection: NO.", VerdictSpec("label", labels=LABELS), 0.0),
    ("partly right", VerdictSpec("label", labels=LABELS), 0.5),
    ("nothing useful (yesterday)", VerdictSpec("label", labels=LABELS), None),   # whole words only
])
def test_verdict_table(text, spec, expected):
    got = parse_verdict(text, spec)
    assert got == pytest.approx(expected) if expected is not None else got is None


def test_combine_modes():
    assert combine_scores(None, [0.5, 1.0], "judge", 1.0) == [0.5, 1.0]
    assert combine_scores([1.0, 0.0], [0.5, 1.0], "sum", 0.5) == [1.25, 0.5]
    assert combine_scores([1.0, 0.0], [0.5, 1.0], "product", 1.0) == [0.5, 0.0]


# -- the judge's engine --------------------------------------------------------------------------------------------
def test_judge_engine_equals_transformers_generate(tmp_path):
    from transformers import LlamaForCausalLM
    path = tiny_judge(tmp_path / "judge")
    cfg = load_config(None, judge_overrides(path, "reward_model.rollout.response_length=12"))
    worker = JudgeWorker(cfg, None, device=torch.device("cpu"))
    prompts = [worker.judge_prompt_ids(t) for t in ("Q: 1+2? A: 3", "Q: 7+8? A: 14, a longer answer here")]
    answers = worker._generate(prompts)
    hf = LlamaForCausalLM.from_pretrained(path).eval()
    for ids, answer in zip(prompts, answers):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                              eos_token_id=worker.tokenizer.eos_token_id, pad_token_id=0)[0, len(ids):].tolist()
        assert answer == out
    sampled = load_config(None, judge_overrides(path, "reward_model.rollout.response_length=12",
                                                "reward_model.rollout.do_sample=true", "reward_model.rollout.seed=7"))
    first, again = (JudgeWorker(sampled, None, device=torch.device("cpu"))._generate(prompts) for _ in range(2))
    assert first == again and first != answers                  # sampled, seeded by rollout.seed and the call


def test_two_steps_score_with_the_judge(tmp_path):
    path = tiny_judge(tmp_path / "judge")
    cfg = load_config(None, [*RUN, *judge_overrides(path, "reward_model.judge.default_score=-1"),
                             f"trainer.default_local_dir={tmp_path / 'run'}"])
    trainer = build_trainer(cfg)
    assert isinstance(trainer.reward_model, JudgeWorker)
    seen = []
    trainer.reward_model.compute_rm_score = lambda batch, judge=trainer.reward_model.compute_rm_score: (
        seen.append((batch, judge(batch))) or seen[-1][1])      # each step's batch and the judge's answer
    with trainer_closed(trainer):
        fit(trainer)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(seen) == 2
    spec = VerdictSpec("score", 0, 99)
    texts = [text for _, out in seen for text in out["judge_texts"]]
    parsed = [parse_verdict(t, spec) is not None for t in texts]
    assert any(parsed), texts                                     # the verdicts are numbers the parser reads
    for metrics, (batch, out) in zip(rows, seen):
        verdicts = [parse_verdict(text, spec) for text in out["judge_texts"]]
        expected = torch.tensor([-1.0 if v is None else v for v in verdicts])
        assert torch.equal(out["judge_scores"], expected)
        assert abs(metrics["critic/score/mean"] - expected.mean().item()) < 1e-6
        assert abs(metrics["reward_judge/score/mean"] - expected.mean().item()) < 1e-6
        failures = sum(v is None for v in verdicts) / len(verdicts)
        assert abs(metrics["reward_judge/parse_failure_rate"] - failures) < 1e-6
        assert metrics["reward_judge/prompt_overflow_rate"] == 0.0
        assert metrics["reward_judge/response_tokens"] > 0 and metrics["timing_s/reward_judge"] > 0
        assert "reward_extra/acc/mean" not in metrics                # combine=judge: the rules were not called
    batch, out = seen[0]                                               # row 0's judge prompt, rendered by hand
    response = trainer.tokenizer.decode(batch["responses"][0].tolist()[:int(batch["attention_mask"][0, -4:].sum())],
                                        skip_special_tokens=True)
    text = TEMPLATE.replace("{question}", batch["raw_prompt"][0][-1]["content"]).replace("{response}", response)
    text = text.replace("{ground_truth}", str(batch["ground_truth"][0]))
    assert trainer.reward_model.judge_texts(batch)[0] == text
    from transformers import LlamaForCausalLM                          # and its verdict is transformers' greedy one
    judge = trainer.reward_model
    ids = judge.judge_prompt_ids(text)
    with torch.no_grad():
        greedy = LlamaForCausalLM.from_pretrained(path).eval().generate(
            torch.tensor([ids]), max_new_tokens=3, do_sample=False, eos_token_id=judge.tokenizer.eos_token_id,
            pad_token_id=0)[0, len(ids):]
    assert out["judge_texts"][0] == judge.tokenizer.decode(greedy, skip_special_tokens=True)


def test_prompts_too_long_and_failures_score_the_default(tmp_path):
    from lathe.batch import Batch
    from lathe.data.builtin import builtin_tokenizer
    from lathe.workers.judge import judge_metrics
    path = tiny_judge(tmp_path / "judge")
    cfg = load_config(None, judge_overrides(path, "reward_model.rollout.prompt_length=60",
                                            "reward_model.judge.default_score=-2", "reward_model.judge.parser=label",
                                            "reward_model.judge.labels={zzz:1.0}"))
    tok = builtin_tokenizer()
    responses = [tok.encode("12", add_special_tokens=False), tok.encode("x" * 40, add_special_tokens=False)]
    width = max(map(len, responses))
    batch = Batch({"responses": torch.tensor([r + [0] * (width - len(r)) for r in responses]),
                   "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in responses])},
                  {"raw_prompt": [[{"role": "user", "content": "1+1="}]] * 2, "ground_truth": ["2", None]})
    out = JudgeWorker(cfg, tok, device=torch.device("cpu")).compute_rm_score(batch)
    assert out["judge_scores"].tolist() == [-2.0, -2.0]             # no label in the verdict; row 1 too long
    assert out["judge_judged"].tolist() == [1.0, 0.0] and out["judge_parsed"].tolist() == [0.0, 0.0]
    metrics = judge_metrics(out, 0.5)
    assert metrics["reward_judge/parse_failure_rate"] == 1.0 and metrics["reward_judge/prompt_overflow_rate"] == 0.5
    assert metrics["reward_judge/response_tokens"] == len(out["judge_texts"][0]) and out["judge_texts"][1] == ""


def test_ranks_shares_judge_as_one_process(tmp_path):
    """The Ray path's dispatch (`RewardModelGroup`: equal shares, answers put back in order) over judges built as a
    rank builds them gives one process's greedy verdicts (the ranks run in this process: no Ray is started)."""
    from lathe.batch import Batch
    from lathe.cluster.roles import RewardModelGroup
    from lathe.data.builtin import builtin_tokenizer
    from lathe.workers.build import build_reward_model
    cfg = load_config(None, judge_overrides(tiny_judge(tmp_path / "judge")))
    tok = builtin_tokenizer()
    responses = [tok.encode(t, add_special_tokens=False) for t in ("12", "7", "a longer one", "3+4=7")]
    width = max(map(len, responses))
    batch = Batch({"responses": torch.tensor([r + [0] * (width - len(r)) for r in responses]),
                   "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in responses])},
                  {"raw_prompt": [[{"role": "user", "content": f"{i}+1="}] for i in range(4)],
                   "ground_truth": [str(i + 1) for i in range(4)]})
    ranks = [build_reward_model(cfg, None, tok, device_type="cpu") for _ in range(2)]

    class Group:                        # a worker group's call_each, run here
        world_size = 2

        def call_each(self, role, method, calls):
            return [getattr(w, method)(*args, **kw) for w, (args, kw) in zip(ranks, calls)]

    joined = RewardModelGroup(Group(), balance=True).compute_rm_score(batch)
    alone = ranks[0].compute_rm_score(batch)
    assert list(joined["judge_texts"]) == list(alone["judge_texts"])
    for key in ("judge_scores", "judge_parsed", "judge_prompt_tokens", "judge_response_tokens"):
        assert torch.equal(joined[key], alone[key]), key


# -- refused up front ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, key", [
    (["reward_model.judge.prompt_template='Rate: {question}'"], "reward_model.judge.prompt_template"),
    (["reward_model.enable=false"], "reward_model.enable=true"),
    (["reward_model.rollout.n=2"], "reward_model.rollout.n"),
    (["reward_model.rollout.tensor_model_parallel_size=2"], "reward_model.rollout.tensor_model_parallel_size"),
    (["reward_model.judge.score_range=[5,5]"], "reward_model.judge.score_range"),
    (["reward_model.judge.weight=0.5"], "reward_model.judge.weight"),               # combine=judge reads no weight
    (["reward_model.model.fsdp_config.param_offload=true", "reward_model.rollout.enforce_eager=false"],
     "reward_model.rollout.enforce_eager"),
])
def test_bad_judge_configs_are_refused(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, judge_overrides(tmp_path, *overrides))


def test_bad_judge_checkpoints_are_refused(tmp_path):
    from helpers import tiny_reward_model
    (tmp_path / "empty").mkdir()
    cases = {str(tmp_path / "missing"): "no such directory", str(tmp_path / "empty"): "no config.json",
             "builtin:tiny": "not a built-in shape",
             tiny_reward_model(tmp_path / "rm"): "lathe's decoder only"}
    for path, why in cases.items():
        with pytest.raises(ValueError, match=rf"reward_model\.model\.path='?{re.escape(path)}'?.*{why}"):
            preflight(load_config(None, judge_overrides(path)))
    bad_vocab = tiny_judge(tmp_path / "vocab", vocab_extra=3)     # ids the judge model cannot read
    with pytest.raises(ValueError, match=r"reward_model\.model\.path=.*110 tokens but its model scores 107"):
        JudgeWorker(load_config(None, judge_overrides(bad_vocab)), None, device=torch.device("cpu"))
    no_template = tiny_judge(tmp_path / "plain", chat_template=False)
    with pytest.raises(ValueError, match=r"reward_model\.judge\.apply_chat_template=false"):
        JudgeWorker(load_config(None, judge_overrides(no_template)), None, device=torch.device("cpu"))
    raw = load_config(None, judge_overrides(no_template, "reward_model.judge.apply_chat_template=false"))
    worker = JudgeWorker(raw, None, device=torch.device("cpu"))
    assert worker.judge_prompt_ids("1+1") == worker.tokenizer("1+1", add_special_tokens=False)["input_ids"]


def test_verdicts_join_the_rule_scores():
    """combine=sum/product: the rule scorers run too; their extras (acc) stay; combine=judge: they are not called."""
    from lathe.batch import Batch
    from lathe.data.builtin import builtin_tokenizer
    from lathe.loop.steps import compute_reward
    from lathe.reward import ScoreResult

    class Rules:
        calls = 0

        def score(self, items):
            self.calls += 1
            return [ScoreResult(float(i), {"acc": float(i)}) for i in range(len(items))]

        def metrics(self):
            return {}

    batch = Batch({"responses": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long),
                   "response_mask": torch.ones(2, 3, dtype=torch.long)},
                  {"data_source": ["a", "a"], "ground_truth": ["1", "2"], "extra_info": [{}, {}]})
    tok, rules, verdicts = builtin_tokenizer(), Rules(), torch.tensor([0.5, 0.25])
    for mode, expected in (("sum", [1.0, 1.5]), ("product", [0.0, 0.25])):
        out, _ = compute_reward(batch, tok, rules, rm_scores=verdicts, combine=(mode, 2.0 if mode == "sum" else 1.0))
        assert out["seq_scores"].tolist() == expected and out["acc"].tolist() == [0.0, 1.0]
        assert out["token_level_scores"][:, -1].tolist() == expected
    out, _ = compute_reward(batch, tok, rules, rm_scores=verdicts, combine=("judge", 1.0))
    assert out["seq_scores"].tolist() == [0.5, 0.25] and rules.calls == 2


@pytest.mark.gpu
def test_cuda_judge_sleeps_and_waits_in_host_memory_between_calls(tmp_path):
    """On a GPU (not run on CPU machines): the judge's KV cache is freed and its weights are in host memory between
    calls, and its greedy float32 verdicts equal the CPU judge's."""
    path = tiny_judge(tmp_path / "judge")
    extra = ("reward_model.rollout.dtype=float32", "reward_model.rollout.response_length=12",
             "reward_model.model.fsdp_config.param_offload=true")
    cfg = load_config(None, judge_overrides(path, *extra))
    gpu = JudgeWorker(cfg, None, device=torch.device("cuda"))
    cpu = JudgeWorker(cfg, None, device=torch.device("cpu"))
    prompts = [cpu.judge_prompt_ids(t) for t in ("Q: 1+2? A: 3", "Q: 7+8? A: 15")]
    for _ in range(2):
        assert gpu._generate(prompts) == cpu._generate(prompts)
        assert not gpu.engine.kv_cache.allocated
        assert all(p.device.type == "cpu" for p in gpu.engine.model.parameters())
