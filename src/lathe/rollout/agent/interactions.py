"""Simulated users (verl's interactions, `actor_rollout_ref.rollout.multi_turn.interaction_config_path`).

When a model turn calls no tool, the trajectory's interaction reads the conversation and answers as the user: a
message the model reads in a new user turn, whether the conversation ends, and a score for the turn (verl's
`turn_scores`). An interaction is a `BaseInteraction` subclass with verl's methods (``async def`` or plain):

    start_interaction(instance_id, **interaction_kwargs) -> instance id
    generate_response(instance_id, messages) -> (should_terminate, response_text, score, metrics)
    calculate_score(instance_id) -> float
    finalize_interaction(instance_id)

A data row picks its interaction and arguments with verl's ``extra_info["interaction_kwargs"]`` (``name`` plus the
arguments of `start_interaction`, e.g. ``ground_truth``); with one interaction configured, ``name`` may be omitted.
The YAML is verl's shape:

    interaction:
      - name: gsm8k
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction   # or lathe's, or your module.Class
        config: {}

A failing or slow interaction ends its trajectory (logged and counted as an error), never the run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lathe.rollout.agent.tools import ToolConfigError, ToolTimeout, _describe, run_with_timeout

log = logging.getLogger("lathe")
VERL_INTERACTIONS = {"verl.interactions.gsm8k_interaction.Gsm8kInteraction": "Gsm8kInteraction"}


class BaseInteraction:
    """verl's interaction interface; override `generate_response` (and the others for per-trajectory state)."""

    def __init__(self, config: dict | None = None):
        self.config = dict(config or {})
        self.name = self.config.get("name", type(self).__name__)

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict], **kwargs) -> tuple[bool, str, float,
                                                                                                    dict]:
        raise NotImplementedError(f"{type(self).__name__}.generate_response")

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        return None


class Gsm8kInteraction(BaseInteraction):
    """verl's GSM8K interaction: the user checks the last answer ("#### <number>", GSM8K's strict format) and says
    whether it is right; a right answer ends the conversation with score 1."""

    def __init__(self, config: dict | None = None):
        super().__init__(config)
        self._state: dict[str, dict] = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs) -> str:
        self._state[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        answer = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._state[instance_id]["response"] = answer
        score = await self.calculate_score(instance_id)
        if score == 1.0:
            return True, "Your response is correct!", score, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", score, {}

    async def calculate_score(self, instance_id, **kwargs) -> float:
        from lathe.reward.gsm8k import compute_score
        state = self._state[instance_id]
        return float(compute_score(state["response"], str(state["ground_truth"]), method="strict", format_score=0.0,
                                   score=1.0))

    async def finalize_interaction(self, instance_id, **kwargs) -> None:
        self._state.pop(instance_id, None)


@dataclass
class UserTurn:
    """The simulated user's answer to one model turn."""

    text: str
    terminate: bool
    score: float = 0.0
    error: bool = False
    seconds: float = 0.0


class InteractionSession:
    """One trajectory's interaction instance (started on first use)."""

    def __init__(self, interaction: BaseInteraction, trajectory_id: str, kwargs: dict, timeout_s: float):
        self.interaction, self.trajectory_id, self.kwargs, self.timeout_s = interaction, trajectory_id, kwargs, timeout_s
        self.instance: str | None = None

    def respond(self, messages: list[dict]) -> UserTurn:
        """The user's next message; never raises (a failure ends the conversation, as an error)."""
        start, name = time.monotonic(), self.interaction.name
        try:
            if self.instance is None:
                instance = run_with_timeout(lambda: self.interaction.start_interaction(self.trajectory_id,
                                                                                       **self.kwargs),
                                            self.timeout_s, name)
                self.instance = self.trajectory_id if instance is None else instance
            out = run_with_timeout(lambda: self.interaction.generate_response(self.instance, list(messages)),
                                   self.timeout_s, name)
            terminate, text, score, *_ = out
            return UserTurn(str(text or ""), bool(terminate), float(score or 0.0), seconds=time.monotonic() - start)
        except (ToolTimeout, Exception) as e:       # noqa: BLE001 - one trajectory's interaction failing ends it
            log.warning("interaction %s failed for trajectory %s: %s", name, self.trajectory_id, _describe(e))
            return UserTurn("", True, error=True, seconds=time.monotonic() - start)

    def close(self) -> None:
        if self.instance is None:
            return
        try:
            run_with_timeout(lambda: self.interaction.finalize_interaction(self.instance), self.timeout_s,
                             self.interaction.name)
        except (ToolTimeout, Exception) as e:       # noqa: BLE001 - close never raises
            log.warning("finalize_interaction of %s failed: %s", self.interaction.name, _describe(e))
        self.instance = None


class InteractionSet:
    """The run's interactions by name."""

    def __init__(self, interactions: dict[str, BaseInteraction], *, timeout_s: float = 30.0):
        self.interactions, self.timeout_s = dict(interactions), timeout_s

    def open(self, trajectory_id: str, interaction_kwargs: dict | None) -> InteractionSession | None:
        """The trajectory's session from its row's ``extra_info["interaction_kwargs"]`` (None: no interaction)."""
        if interaction_kwargs is None:
            return None
        if not isinstance(interaction_kwargs, dict):
            raise TypeError(f"extra_info.interaction_kwargs of trajectory {trajectory_id} is {interaction_kwargs!r:.200}"
                            "; write {name: <interaction>, ...its start_interaction arguments} (verl's layout)")
        kwargs = dict(interaction_kwargs)
        name = kwargs.pop("name", None)
        if name is None and len(self.interactions) == 1:
            name = next(iter(self.interactions))
        if name not in self.interactions:
            raise ValueError(f"extra_info.interaction_kwargs.name={name!r} of trajectory {trajectory_id}: the "
                             f"interactions are {sorted(self.interactions)} (interaction_config_path)")
        return InteractionSession(self.interactions[name], trajectory_id, kwargs, self.timeout_s)


def load_interactions(path: str | Path, *, timeout_s: float = 30.0) -> InteractionSet:
    """verl's interaction YAML (``interaction:`` entries of name, class_name, config)."""
    file = Path(path).expanduser()
    try:
        data = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise ToolConfigError(f"{file}: not a readable interaction YAML file: {e}. Fix: point "
                              "actor_rollout_ref.rollout.multi_turn.interaction_config_path at one") from None
    entries = data.get("interaction") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"{file}: needs a top-level 'interaction:' list of entries (name, class_name, config), "
                              "as verl's interaction configs have")
    out: dict[str, BaseInteraction] = {}
    for index, entry in enumerate(entries):
        where = f"{file}: interaction[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ToolConfigError(f"{where}: write a mapping with class_name (and name, config)")
        cls = _interaction_class(entry["class_name"].strip(), where)
        config = {**(entry.get("config") or {}), "name": entry.get("name") or cls.__name__}
        try:
            interaction = cls(config)
        except Exception as e:
            raise ToolConfigError(f"{where}: {cls.__name__}(config) failed: {type(e).__name__}: {_describe(e)}") from e
        if config["name"] in out:
            raise ToolConfigError(f"{where}: the name {config['name']!r} is already used; give each its own name")
        out[config["name"]] = interaction
    return InteractionSet(out, timeout_s=timeout_s)


def _interaction_class(class_name: str, where: str) -> Any:
    if class_name in VERL_INTERACTIONS:
        return globals()[VERL_INTERACTIONS[class_name]]
    if class_name.startswith("verl."):
        raise ToolConfigError(f"{where}: {class_name}: lathe ships no equivalent of this verl interaction; write it "
                              "as a lathe.rollout.agent.interactions.BaseInteraction subclass")
    from lathe.rollout.agent.builtin_tools import resolve_tool_class
    try:
        cls = resolve_tool_class(class_name)
    except (ToolConfigError, ValueError, TypeError) as e:
        raise ToolConfigError(f"{where}: {e}") from None
    if not isinstance(cls, type) or not callable(getattr(cls, "generate_response", None)):
        raise ToolConfigError(f"{where}: {class_name} is not an interaction class (it needs generate_response); "
                              "derive it from lathe.rollout.agent.interactions.BaseInteraction")
    return cls


__all__ = ["BaseInteraction", "Gsm8kInteraction", "InteractionSession", "InteractionSet", "UserTurn",
           "load_interactions"]
