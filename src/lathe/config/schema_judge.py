"""A generative reward model (an LLM judge): ``reward_model.judge.*`` (lathe's) and ``reward_model.rollout.*`` (verl's).

verl serves a generative reward model (GenRM) from ``reward.reward_model.model_path`` with an inference engine
configured by ``reward.reward_model.rollout.*`` and leaves the judge prompt and the verdict's parsing to a custom
reward function. lathe builds the judge in: with ``reward_model.enable=true``, ``reward_model.model.path`` a causal
LM checkpoint (verl's ``reward.reward_model.model_path``) and ``reward_model.judge.enable=true``, each response is
put into ``judge.prompt_template``, the judge answers on lathe's engine (``lathe.workers.judge``) with the sampling
and engine settings of ``reward_model.rollout`` (verl's names and defaults; ``reward.reward_model.rollout.*`` is the
same group), and ``judge.parser`` turns the answer into a number that replaces or joins the rule score
(``judge.combine``). The keys of verl's rollout group that lathe's engine has no counterpart for stay verl keys
(``lathe.config.support_verl``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .choices import RolloutDtype
from .coerce import spec

DEFAULT_TEMPLATE = ("Rate the response to the question below from 0 to 10 (10: fully correct).\n\n"
                    "Question: {question}\n\nReference answer: {ground_truth}\n\nResponse: {response}\n\n"
                    "End your answer with the rating, a single number.")
JudgeParser = Literal["score", "boxed", "label"]
JudgeCombine = Literal["judge", "sum", "product"]


@dataclass
class JudgeConfig:
    """lathe ``reward_model.judge``: the judge prompt, the verdict parser and how the verdict becomes the reward."""

    enable: bool = spec(False, "lathe: the reward model is a generative judge (a causal LM served by lathe's engine) "
                               "instead of a sequence-classification model; needs reward_model.enable=true.")
    prompt_template: str = spec(DEFAULT_TEMPLATE, "lathe: the judge's prompt. {question} (the prompt's last user "
                                                  "message), {response} (the decoded response; required) and "
                                                  "{ground_truth} (the row's reward_model.ground_truth, empty when "
                                                  "absent) are replaced; other braces stay as written.")
    apply_chat_template: bool = spec(True, "lathe: send the rendered prompt as one user message through the judge "
                                           "tokenizer's chat template (with the generation prompt); false = the "
                                           "raw text, tokenized without special tokens.")
    parser: JudgeParser = spec("score", "lathe: how the verdict is read: score (the last number of the answer), "
                                        "boxed (the last \\boxed{...}: a number, or one of labels) or label (the "
                                        "last of labels' words in the answer, whole word, any case).")
    score_range: list[float] = spec([0.0, 10.0], "lathe: [low, high] of a numeric verdict; it is normalised to "
                                                 "(x - low) / (high - low); a number outside fails to parse.")
    labels: dict[str, float] = spec({"yes": 1.0, "no": 0.0}, "lathe: verdict words and their scores (parser=label, "
                                                              "and boxed verdicts that are not numbers).")
    default_score: float = spec(0.0, "lathe: the score of a verdict that does not parse, and of a judge prompt "
                                     "longer than reward_model.rollout.prompt_length (not judged); both counted.")
    combine: JudgeCombine = spec("judge", "lathe: judge (the verdict is the reward; rule scorers not called), sum "
                                          "(rule score + weight x verdict) or product (rule score x verdict).")
    weight: float = spec(1.0, "lathe: the verdict's weight with combine=sum.")


@dataclass
class JudgeRolloutConfig:
    """verl ``reward.reward_model.rollout`` (also ``reward_model.rollout``): the judge's engine and sampling.

    Read only with ``reward_model.judge.enable``. Defaults are verl's (sampled at temperature 1; set
    ``do_sample=false`` for a greedy judge)."""

    dtype: RolloutDtype = spec("bfloat16", "Judge weights and KV-cache dtype on CUDA; CPU runs use float32.")
    gpu_memory_utilization: float = spec(0.5, "Share of the device's memory the judge's KV cache may bring the "
                                              "total to.")
    enforce_eager: bool = spec(True, "true = the judge's decode steps run without CUDA graphs.")
    cudagraph_capture_sizes: list[int] | None = spec(None, "Decode batch sizes captured as CUDA graphs.")
    free_cache_engine: bool = spec(True, "Free the judge's KV cache between uses (CUDA; training takes the memory).")
    tensor_model_parallel_size: int = spec(1, "Ranks per judge replica; lathe's judge is a whole copy per rank (1).")
    max_num_batched_tokens: int = spec(8192, "Tokens per engine step (prefill chunk budget).")
    max_model_len: int | None = spec(None, "Judge context length; null = prompt_length + response_length.")
    max_num_seqs: int = spec(1024, "Judge prompts decoded together at most.")
    enable_chunked_prefill: bool = spec(True, "Split long judge prompts' prefill over steps.")
    enable_prefix_caching: bool = spec(True, "Share the KV of judge prompts' common prefixes (the template's).")
    temperature: float = spec(1.0, "Judge sampling temperature; 0 = greedy.")
    top_k: int = spec(-1, "Sample from the k most likely tokens; -1 = off.")
    top_p: float = spec(1.0, "Nucleus sampling mass; 1 = off.")
    do_sample: bool = spec(True, "false = greedy judging, whatever the temperature.")
    n: int = spec(1, "Verdicts per response; lathe's judge gives one (1).")
    prompt_length: int = spec(2048, "Longest judge prompt in the judge's tokens; a longer one is not judged "
                                    "(default_score, counted as reward_judge/prompt_overflow_rate).")
    response_length: int = spec(2048, "Most tokens of a verdict.")
    seed: int = spec(42, "Seed of a sampled judge (mixed with a hash of the call's judge prompts).")
