"""A sequence-classification reward model on lathe's decoder: the backbone and the checkpoint's `score` head.

transformers' `*ForSequenceClassification` is the backbone (`model.*`) plus `score`, a Linear(hidden, num_labels)
without bias, read at each row's last real token. Its tensors carry the names of lathe's critic
(`LatheValueModel`: the same backbone and a one-output `score`), so `lathe_reward_model` turns a loaded transformers
reward model into lathe's decoder by handing over the tensors themselves (no copy), and `packed_scores` scores
rows laid end to end (no padding: `cu_seqlens` as the actor's packed forward) and applies the head to each row's
last hidden state only.

What lathe's decoder does not run (another architecture, several labels, a head with a bias) raises
`UnsupportedArchitecture`; the caller keeps transformers' padded forward then.
"""

from __future__ import annotations

import torch

from lathe.models.config import VALUE_ARCHITECTURES, LatheConfig, UnsupportedArchitecture
from lathe.models.packing import pack_sequences

SEQ_CLS, TOKEN_CLS = "ForSequenceClassification", "ForTokenClassification"
FALLBACK = "; transformers' forward will score it"


def lathe_reward_model(model):
    """lathe's `LatheValueModel` holding the tensors of `model`, a transformers `*ForSequenceClassification` with one
    label, or `UnsupportedArchitecture`. The tensors are shared, not copied: drop `model` afterwards."""
    from lathe.models.decoder import LatheValueModel
    from lathe.models.io import load_into
    name = type(model).__name__
    source = f"{name} ({getattr(model.config, '_name_or_path', '') or 'in memory'})"
    critic = name.replace(SEQ_CLS, TOKEN_CLS)
    if not name.endswith(SEQ_CLS) or critic not in VALUE_ARCHITECTURES:
        raise UnsupportedArchitecture(f"{source}: lathe's decoder does not implement {name}{FALLBACK}")
    cfg = LatheConfig.from_hf_dict({**model.config.to_dict(), "architectures": [critic]}, source=source)
    cfg.tie_word_embeddings = False                     # no lm_head
    state = {k: v.detach() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    head = state.get("score.weight")
    if head is None or tuple(head.shape) != (1, cfg.hidden_size) or "score.bias" in state:
        shape = None if head is None else tuple(head.shape)
        raise UnsupportedArchitecture(f"{source}: score head of shape {shape}{' with a bias' * ('score.bias' in state)}"
                                      f" (lathe reads one label, Linear({cfg.hidden_size}, 1) without bias){FALLBACK}")
    with torch.device("meta"):
        lathe = LatheValueModel(cfg, score_bias=False)
    load_into(lathe, state, source)
    return lathe.eval().requires_grad_(False)


@torch.no_grad()
def packed_scores(model, rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """(len(rows),) float32 on the CPU: `model`'s (a `LatheValueModel`) score at the last token of each row, from one
    packed forward of all the rows."""
    ids, positions, cu_seqlens, longest = pack_sequences([torch.tensor(r, dtype=torch.long) for r in rows])
    hidden = model.hidden_packed(ids.to(device), positions.to(device), cu_seqlens.to(device), longest)
    last = (cu_seqlens[1:] - 1).to(device=device, dtype=torch.long)
    return model.score(hidden[last])[:, 0].float().cpu()
