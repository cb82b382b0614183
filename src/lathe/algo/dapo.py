"""DAPO's dynamic sampling filter and overlong reward shaping (Yu et al. 2025, arXiv:2503.14476).

verl keys: ``algorithm.filter_groups.{enable, metric, max_num_gen_batches}`` and
``reward_model.overlong_buffer.{enable, len, penalty_factor}``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lathe.algo.utils import group_ids

__all__ = ["filter_groups", "overlong_reward_penalty"]


def filter_groups(index: Sequence | np.ndarray, metric_values) -> np.ndarray:
    """Dynamic sampling: keep-mask (B,) bool dropping prompt groups whose metric has zero variance.

    A group whose samples all score the same (all right or all wrong) has zero GRPO advantage and so no
    gradient; DAPO drops it and samples more prompts. Groups of a single sample are kept (as verl: their
    std is undefined, not zero). ``metric_values`` is one number per row (e.g. ``acc`` or ``seq_reward``).
    """
    values = np.asarray(
        metric_values.detach().cpu().numpy() if isinstance(metric_values, torch.Tensor) else metric_values,
        dtype=np.float64,
    ).reshape(-1)
    gid, counts = group_ids(index, len(values))
    gid, counts = gid.numpy(), counts.numpy()
    keep_group = np.zeros(len(counts), dtype=bool)
    for g in range(len(counts)):
        group = values[gid == g]
        keep_group[g] = len(group) == 1 or float(np.std(group)) > 0.0
    return keep_group[gid]


def overlong_reward_penalty(
    response_lengths, max_response_length: int, overlong_buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """Soft overlong punishment, DAPO eq. (13), scaled by ``penalty_factor``: (B,) rewards to ADD.

    With ``L_max = max_response_length``, ``L_cache = overlong_buffer_len`` and ``|y|`` the response length:
    0 if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` inside the buffer; -1 beyond
    ``L_max``. verl's DAPO reward manager applies the same linear ramp.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"reward_model.overlong_buffer.len={overlong_buffer_len} must be in (0, max_response_length="
            f"{max_response_length}]"
        )
    lengths = torch.as_tensor(response_lengths).to(torch.float32).reshape(-1)
    expected = max_response_length - overlong_buffer_len
    exceed = (lengths - expected) / overlong_buffer_len
    return -penalty_factor * exceed.clamp(min=0.0, max=1.0)
