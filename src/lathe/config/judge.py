"""The rules of a generative judge (`reward_model.judge.*`, `reward_model.rollout.*`), checked before anything loads.

Each problem names the key, the value, why it cannot run and the fix (`lathe.config.schema_judge` documents the
keys; `lathe.workers.judge` runs the judge).
"""

from __future__ import annotations

from .errors import ProblemList

J, RO = "reward_model.judge", "reward_model.rollout"


def check_judge(cfg, problems: ProblemList) -> None:
    """`reward_model.judge.enable`: a judge checkpoint, a template with the response, a parser that can read a
    verdict, an engine lathe can build (one verdict, one rank, eager with offloaded weights)."""
    rm = cfg.reward_model
    judge, ro = rm.judge, rm.rollout
    if not judge.enable:
        return
    if not rm.enable:
        problems.add(f"{J}.enable=true needs reward_model.enable=true (the judge is the run's reward model). Fix: set "
                     f"reward_model.enable=true and reward_model.model.path to the judge, or remove {J}.enable.")
    if not rm.model.path:
        problems.add(f"{J}.enable=true needs reward_model.model.path (verl: reward.reward_model.model_path), which "
                     "is not set. Fix: set it to the judge's causal-LM checkpoint directory (or hub id).")
    if "{response}" not in judge.prompt_template:
        problems.add(f"{J}.prompt_template has no {{response}}: the judge would never see the response it scores. "
                     "Fix: put {response} in the template (also available: {question}, {ground_truth}).")
    _check_verdict(judge, problems)
    if judge.weight != 1.0 and judge.combine != "sum":
        problems.add(f"{J}.weight={judge.weight} with {J}.combine={judge.combine}: the weight is read only by "
                     f"combine=sum (rule + weight x verdict). Fix: set {J}.combine=sum, or remove {J}.weight.")
    if ro.n != 1:
        problems.add(f"{RO}.n={ro.n}: several verdicts per response (averaged) are not implemented yet in lathe's "
                     f"judge. Fix: set {RO}.n=1.")
    if ro.tensor_model_parallel_size != 1:
        problems.add(f"{RO}.tensor_model_parallel_size={ro.tensor_model_parallel_size}: a tensor-parallel judge is "
                     f"not implemented yet (lathe's judge is a whole copy on each rank). Fix: set {RO}."
                     "tensor_model_parallel_size=1.")
    for key in ("prompt_length", "response_length", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(ro, key) < 1:
            problems.add(f"{RO}.{key}={getattr(ro, key)} must be >= 1. Fix: raise it.")
    if ro.max_model_len is not None and ro.max_model_len < ro.prompt_length + ro.response_length:
        problems.add(f"{RO}.max_model_len={ro.max_model_len} cannot hold a judge prompt of {RO}.prompt_length="
                     f"{ro.prompt_length} tokens and a verdict of {RO}.response_length={ro.response_length}. Fix: "
                     "raise it (or null: their sum).")
    if rm.model.fsdp_config.param_offload and not ro.enforce_eager:
        problems.add(f"reward_model.model.fsdp_config.param_offload=true with {RO}.enforce_eager=false: the judge's "
                     "weights move to host memory between calls, which the CUDA graphs of a non-eager engine "
                     f"(captured at the weights' device addresses) cannot follow. Fix: set {RO}.enforce_eager=true, or param_offload=false.")


def _check_verdict(judge, problems: ProblemList) -> None:
    """The parser's settings: a numeric range with low < high, labels for label verdicts."""
    rng = judge.score_range
    if len(rng) != 2 or not float(rng[0]) < float(rng[1]):
        problems.add(f"{J}.score_range={list(rng)} must be [low, high] with low < high (a numeric verdict x becomes "
                     f"(x - low) / (high - low)). Fix: e.g. {J}.score_range=[0,10].")
    if judge.parser == "label" and not judge.labels:
        problems.add(f"{J}.parser=label needs {J}.labels (verdict words and their scores), which is empty. Fix: e.g. "
                     f"{J}.labels={{yes:1.0,no:0.0}}.")
    empty = [k for k in judge.labels if not str(k).strip()]
    if empty:
        problems.add(f"{J}.labels has an empty label. Fix: give every label a word.")
