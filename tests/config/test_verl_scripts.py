"""verl's example launch scripts (``verl_scripts/*.txt``) load, or stop only on features lathe names.

A problem is fine when it refuses a named feature (a registry or support_verl refusal: "tensor parallelism
(lathe issue 43: ...)"), or when it is one of the known others below, each with its reason. Anything else (an
unknown key, a value lathe should accept) fails the script's test. ``verl_corpus.py`` prints the whole table.
"""

from __future__ import annotations

import re

import pytest

from pathlib import Path

from config.verl_corpus import names, problems, refused_features, table

# Known problems that are not a named refusal, with why they stay.
KNOWN_OTHERS = {
    r"sequences per (mini-batch|step) is not divisible by the device": "lathe's batch rules split over its "
        "data-parallel ranks, world / (TP x Ulysses); verl's over world / (TP x PP x CP), fewer once Megatron's PP "
        "runs as FSDP sharding (and its TP beside EP is dropped); an uneven split needs ragged shares (see issue 45)",
    r"^actor_rollout_ref\.model\.mtp\.enable_train=true with .*: training the MTP layers beside it is not": "a "
        "cross-field rule (config/rules_mtp.py): a verl MiMo script trains the MTP layers under Megatron's context "
        "parallelism (translated to Ulysses), which lathe's MTP update does not combine with yet",
    r"^unknown key actor_rollout_ref\.actor\.engine\.": "the megatron-lite package's keys (after the refused "
        "Hydra config-group selection that brings them)",
    r"^unknown key actor_rollout_ref\.actor\.model_engine$": "not a key of verl's schema either: Hydra refuses it "
        "without a leading +",
    r"^trainer\.device=npu is not one of": "Ascend NPUs: lathe runs on CUDA and CPU",
    r"ulysses_sequence_parallel_size=\d+ splits the packed stream .* runs it padded": "Megatron's context "
        "parallelism (translated to Ulysses) in a script that runs padded: lathe's sequence parallelism needs "
        "use_remove_padding=true, the fix its message names",
    r"^global_profiler\.tool=npu": "a profiler lathe does not have (refused with its own text)",
    r"^global_profiler\.tool=torch profiles the steps of the synchronous": "lathe's torch profiler covers synchronous "
        "runs",
    r"^actor_rollout_ref\.rollout\.expert_parallel_size=\d+: expert-parallel generation over other than": "a "
        "cross-field rule (config/rules_parallel.py): the engine's expert parallelism spans one tensor-parallel "
        "replica",
}


def unexplained(script: str) -> list[str]:
    features = set(refused_features())
    out = []
    for label, _ in problems(script):
        if label in features or label == "Hydra config-group selection":
            continue
        if not any(re.search(pattern, label) for pattern in KNOWN_OTHERS):
            out.append(label)
    return sorted(set(out))


@pytest.mark.parametrize("script", names())
def test_script_loads_or_stops_on_named_features(script):
    assert not unexplained(script), f"{script}: problems that are neither a named refusal nor known"


def test_the_corpus_is_there():
    assert len(names()) == 92


def test_the_readme_says_what_stops_each_script():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert table() in readme, "README's 'Moving from verl' table is stale: PYTHONPATH=src python tests/config/verl_corpus.py"
