"""Rewards: text in, numbers out.

* rule scorers: :mod:`~lathe.reward.gsm8k`, :mod:`~lathe.reward.math`, :mod:`~lathe.reward.geo3k`, :mod:`~lathe.reward.builtin`,
  dispatched on ``data_source`` by :func:`default_compute_score` (as in verl);
* user functions with verl's signature: :func:`load_reward_fn`;
* :class:`RewardManager`: scores batches so that a raising, hanging or crashing scorer
  costs one sample (scored 0, counted), never the run;
* :class:`BatchRewardManager`: verl's ``batch`` manager, one call of the user's function per batch
  (a call that fails, or returns the wrong number of results, stops the run naming both).
"""

from lathe.reward.batch import BatchRewardError, BatchRewardManager
from lathe.reward.custom import RewardFn, load_reward_fn
from lathe.reward.manager import RewardManager, ScoreResult
from lathe.reward.registry import default_compute_score

__all__ = ["BatchRewardError", "BatchRewardManager", "RewardFn", "RewardManager", "ScoreResult",
           "default_compute_score", "load_reward_fn"]
