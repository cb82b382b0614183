"""Master weights on one device for any optimizer: the module computes in `param_dtype` (bf16), the optimizer
updates `master_dtype` (fp32) copies (see `lathe.train.precision`).

`MasterWeights` is what every such optimizer shares: `module_params`, the module's trainable parameters (cast to
`param_dtype` in place by the optimizer's construction, their original tensors becoming the masters); a
post-accumulate hook on each that adds the micro-batch's gradient into a `reduce_dtype` buffer and frees it at once;
gradient clipping over those buffers (`lathe.train.update.clipped_step` calls it); the masters by parameter name, for
checkpoints (`lathe.train.update.save_trainable`). `lathe.train.master.MasterAdamW` (lathe's AdamW, which can stream
its state through the device from host memory) is one; `master_optimizer` makes the others.

`master_optimizer(cls, params, policy=...)`: any `torch.optim.Optimizer` class (SGD, Adam, torchao's, ...) over the
masters: each `step()` hands it the accumulated gradients as the masters' `.grad`, runs its own `step`, and casts
the updated masters back into the module. Its state is the class's own (`state_dict()` as the class writes it, by
index, so a checkpoint resumes into the same class on one device). It keeps everything on the device: lathe offloads
on one device through `MasterAdamW` only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lathe.train.precision import PrecisionPolicy


class MasterWeights:
    """A mixin for optimizers over master copies of `module_params`; the class sets `module_params`, `policy`,
    `device` and calls `_hook_gradients()` once its masters exist."""

    module_params: list[nn.Parameter]
    policy: PrecisionPolicy
    device: torch.device
    grads: list[torch.Tensor | None]

    def _hook_gradients(self) -> None:
        self.grads = [None] * len(self.module_params)
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate_hook(i))
                       for i, p in enumerate(self.module_params)]

    def _accumulate_hook(self, i: int):
        reduce_dtype = self.policy.reduce_dtype

        def hook(p: torch.Tensor) -> None:
            grad, p.grad = p.grad, None
            if self.grads[i] is None:
                self.grads[i] = grad.to(reduce_dtype)
            else:
                self.grads[i].add_(grad)
        return hook

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated gradients (always freed: buffers are allocated again by the next backward)."""
        self.grads = [None] * len(self.grads)
        for p in self.module_params:
            p.grad = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the accumulated gradients so that their global 2-norm is at most `max_norm`; returns the norm
        before clipping (as `torch.nn.utils.clip_grad_norm_` does)."""
        grads = [g for g in self.grads if g is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        clip = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, clip.to(grads[0].device))
        return total

    def master_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """`module.state_dict()` with every trained parameter replaced by its master (fp32) weight."""
        self._wait_for_copies()
        masters = self._masters()
        by_id = {id(p): masters[i] for i, p in enumerate(self.module_params)}   # (a master stored transposed,
        return {name: by_id.get(id(t), t).detach().contiguous()                 # as its weight: a copy)
                for name, t in module.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def load_master_state_dict(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Set masters (exactly) and module parameters (cast) from a by-name state such as a checkpoint's."""
        self._wait_for_copies()          # offloaded masters' write-backs land before they are overwritten here
        names = {id(p): name for name, p in module.named_parameters()}
        masters = self._masters()
        for i, p in enumerate(self.module_params):
            name = names.get(id(p))
            if name is None or name not in state:
                raise KeyError(f"{type(self).__name__}: the checkpoint has no tensor for parameter {name!r}")
            masters[i].copy_(state[name])
            p.copy_(masters[i])

    def _wait_for_copies(self) -> None:
        """Wait for copies in flight to host memory before the host reads it (none here)."""

    def _masters(self) -> list[torch.Tensor]:
        """The masters, in `module_params`' order."""
        return [m for g in self.param_groups for m in g["params"]]


class SteppedMasters(MasterWeights):
    """The optimizer class after this one in the method order (`master_optimizer` makes the pair) steps the
    masters; the module gets them back cast."""

    def __init__(self, params: Iterable[nn.Parameter], *, policy: PrecisionPolicy, **kwargs):
        self.module_params = [p for p in params if p.requires_grad]
        if not self.module_params:
            raise ValueError(f"{type(self).__name__}: no trainable parameters")
        self.policy, self.device = policy, self.module_params[0].device
        self.masters = [p.detach().to(policy.master_dtype) for p in self.module_params]  # (the loaded tensors)
        for p in self.module_params:
            p.data = p.data.to(policy.param_dtype)
        super().__init__(self.masters, **kwargs)
        self._hook_gradients()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step takes no closure")
        stepped = [i for i, g in enumerate(self.grads) if g is not None]
        for i in stepped:
            master, grad = self.masters[i], self.grads[i]
            master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
        try:
            super().step()
        finally:
            for i in stepped:
                self.masters[i].grad = None
        for i in stepped:
            self.module_params[i].copy_(self.masters[i])
        return None

    def _masters(self) -> list[torch.Tensor]:
        return self.masters


_CLASSES: dict[type, type] = {}


def master_optimizer(cls: type, params: Iterable[nn.Parameter], *, policy: PrecisionPolicy,
                     **kwargs) -> torch.optim.Optimizer:
    """`cls(masters, **kwargs)` over fp32 masters of `params` (cast to `policy.param_dtype` in place), as an instance
    of `Master<cls name>`, a subclass of both `SteppedMasters` and `cls`."""
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = _CLASSES[cls] = type(f"Master{cls.__name__}", (SteppedMasters, cls),
                                   {"__module__": __name__, "__doc__": f"{cls.__name__} over fp32 master weights."})
    return sub(params, policy=policy, **kwargs)
