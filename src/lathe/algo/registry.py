"""Name -> function registries for advantage estimators and policy losses (verl's names).

A new estimator or loss is one decorated function::

    @register_adv_estimator("my_adv")
    def my_adv(*, token_level_rewards, response_mask, **_): ...

``ADV_ESTIMATORS`` and ``POLICY_LOSSES`` are the live registries (``name in ADV_ESTIMATORS`` is how config
validation checks ``algorithm.adv_estimator`` / ``actor.policy_loss.loss_mode``). Importing anything from
``lathe.algo`` runs the package ``__init__``, which imports the built-in modules, so the registries are full
by the time this module is usable.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

__all__ = [
    "ADV_ESTIMATORS",
    "POLICY_LOSSES",
    "register_adv_estimator",
    "get_adv_estimator",
    "register_policy_loss",
    "get_policy_loss",
    "unknown_name_error",
]

ADV_ESTIMATORS: dict[str, Callable] = {}
POLICY_LOSSES: dict[str, Callable] = {}


def unknown_name_error(kind: str, key: str, name: object, known) -> ValueError:
    """Build the ValueError for an unknown ``name``: lists the known names and the closest match."""
    known = sorted(known)
    close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.0)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ValueError(f"{key}={name!r} is not a known {kind}. Known: {', '.join(known)}.{hint}")


def _register(table: dict[str, Callable], kind: str, name: str) -> Callable[[Callable], Callable]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} names must be non-empty strings, got {name!r}")

    def decorator(fn: Callable) -> Callable:
        old = table.get(name)
        if old is not None and old is not fn and getattr(old, "__qualname__", None) != fn.__qualname__:
            raise ValueError(f"{kind} '{name}' is already registered to {old.__module__}.{old.__qualname__}")
        table[name] = fn
        return fn

    return decorator


def register_adv_estimator(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as the advantage estimator ``algorithm.adv_estimator=name``."""
    return _register(ADV_ESTIMATORS, "advantage estimator", name)


def get_adv_estimator(name: str) -> Callable:
    """Return the registered advantage estimator; unknown names raise ValueError with the known names."""
    if name not in ADV_ESTIMATORS:
        raise unknown_name_error("advantage estimator", "algorithm.adv_estimator", name, ADV_ESTIMATORS)
    return ADV_ESTIMATORS[name]


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as the policy loss ``actor.policy_loss.loss_mode=name``."""
    return _register(POLICY_LOSSES, "policy loss", name)


def get_policy_loss(name: str) -> Callable:
    """Return the registered policy loss; unknown names raise ValueError with the known names."""
    if name not in POLICY_LOSSES:
        raise unknown_name_error("policy loss", "actor.policy_loss.loss_mode", name, POLICY_LOSSES)
    return POLICY_LOSSES[name]
