"""`MasterAdamW`: AdamW over fp32 master weights of a module that computes in bf16, on one device.

This is mixed precision as FSDP2 does it (see `lathe.train.precision`), without sharding:

- the module's parameters become `param_dtype` (bf16) tensors in place: forward, backward, and the rollout
  engine (which may share them) all run on those;
- the optimizer's own parameters are the `master_dtype` (fp32) weights they were cast from — the originals,
  not a copy — on the device, or in pinned CPU memory with `offload_params`;
- a post-accumulate hook on every module parameter adds each micro-batch's bf16 gradient into a
  `reduce_dtype` (fp32) buffer on the device and frees the bf16 gradient at once, so gradient accumulation
  over micro-batches happens in fp32 and bf16 gradients never exist for the whole model at the same time;
- `step()` runs torch's own AdamW kernel (`torch.optim.adam.adam` with decoupled weight decay: fused on CUDA)
  and casts the updated masters back into the module's parameters. With `offload_params` / `offload_state`
  (AdamW's moments in pinned CPU memory) it streams the offloaded tensors through the device in chunks of
  `chunk_numel` elements, so the device never holds them all at once.

The state (`step`, `exp_avg`, `exp_avg_sq` per master) has `torch.optim.AdamW`'s layout, so `state_dict()`
checkpoints are interchangeable between offloaded and resident runs; `torch.optim.lr_scheduler` works on it.
Gradient clipping goes through `clip_grad_norm_` (the gradients are not the masters' `.grad`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.optim.adam import adam

from lathe.device import pin_memory_available, synchronize
from lathe.train.precision import PrecisionPolicy


class MasterAdamW(torch.optim.Optimizer):
    """AdamW on master copies of `params` (a module's trainable parameters, still in their load dtype).

    Construction casts `params` to `policy.param_dtype` in place; the tensors they held become the masters
    (converted to `policy.master_dtype` when they are not already)."""

    def __init__(self, params: Iterable[nn.Parameter], *, policy: PrecisionPolicy, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 offload_params: bool = False, offload_state: bool = False, chunk_numel: int = 1 << 28):
        self.module_params = [p for p in params if p.requires_grad]
        if not self.module_params:
            raise ValueError("MasterAdamW: no trainable parameters")
        self.device = self.module_params[0].device
        if (offload_params or offload_state) and self.device.type != "cuda":
            raise ValueError("MasterAdamW: offloading to CPU memory needs the parameters on a CUDA device")
        self.policy, self.offload_params, self.offload_state = policy, offload_params, offload_state
        self.chunk_numel = chunk_numel
        masters = [self._take_master(p) for p in self.module_params]
        super().__init__(masters, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._index = {id(m): i for i, m in enumerate(masters)}
        self.grads: list[torch.Tensor | None] = [None] * len(masters)
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate_hook(i))
                       for i, p in enumerate(self.module_params)]

    # -- construction ---------------------------------------------------------------------------------
    def _take_master(self, p: nn.Parameter) -> torch.Tensor:
        """The master for `p` (its current tensor, in master dtype, where it lives); `p` becomes param_dtype."""
        master = p.detach().to(self.policy.master_dtype)
        if self.offload_params:
            master = _pinned_copy(master)
        p.data = p.data.to(self.policy.param_dtype)
        return master

    def _accumulate_hook(self, i: int):
        reduce_dtype = self.policy.reduce_dtype

        def hook(p: torch.Tensor) -> None:
            grad, p.grad = p.grad, None
            if self.grads[i] is None:
                self.grads[i] = grad.to(reduce_dtype)
            else:
                self.grads[i].add_(grad)
        return hook

    # -- the torch.optim.Optimizer interface -------------------------------------------------------------
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

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        for group in self.param_groups:
            for chunk in self._chunks([m for m in group["params"] if self.grads[self._index[id(m)]] is not None]):
                self._step_chunk(group, chunk)
        return None

    def state_dict(self) -> dict:
        self._wait_for_copies()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for master in self._masters():
            state = self.state.get(master)
            if state:
                self._place_state(state)

    # -- master weights by name (checkpoints) ---------------------------------------------------------------
    def master_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """`module.state_dict()` with every trained parameter replaced by its master (fp32) weight."""
        self._wait_for_copies()
        by_id = {id(p): self._masters()[i] for i, p in enumerate(self.module_params)}
        return {name: by_id.get(id(t), t).detach() for name, t in module.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def load_master_state_dict(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Set masters (exactly) and module parameters (cast) from a by-name state such as a checkpoint's."""
        names = {id(p): name for name, p in module.named_parameters()}
        for i, p in enumerate(self.module_params):
            name = names.get(id(p))
            if name is None or name not in state:
                raise KeyError(f"MasterAdamW: the checkpoint has no tensor for parameter {name!r}")
            master = self._masters()[i]
            master.copy_(state[name])
            p.copy_(master)

    # -- internals ------------------------------------------------------------------------------------------
    def _wait_for_copies(self) -> None:
        """Offloaded tensors are written back by asynchronous device-to-host copies: wait before the host reads."""
        if self.offload_params or self.offload_state:
            synchronize(self.device)

    def _masters(self) -> list[torch.Tensor]:
        return [m for g in self.param_groups for m in g["params"]]

    def _chunks(self, masters: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """All at once when everything is on the device; else groups of about `chunk_numel` elements."""
        if not (self.offload_params or self.offload_state):
            return [masters] if masters else []
        chunks, size = [[]], 0
        for m in masters:
            if chunks[-1] and size + m.numel() > self.chunk_numel:
                chunks.append([])
                size = 0
            chunks[-1].append(m)
            size += m.numel()
        return chunks if chunks[0] else []

    def _init_state(self, master: torch.Tensor) -> dict:
        state = self.state[master]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=self.device)
            where = "cpu" if self.offload_state else master.device
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = (torch.zeros(master.shape, dtype=master.dtype, pin_memory=True) if where == "cpu"
                              and self.device.type == "cuda" else torch.zeros_like(master, device=where))
        return state

    def _place_state(self, state: dict) -> None:
        """After loading a checkpoint: step on the device, moments where this optimizer keeps them."""
        state["step"] = state["step"].to(device=self.device, dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = _pinned_copy(state[key]) if self.offload_state else state[key].to(self.device)

    def _step_chunk(self, group: dict, masters: list[torch.Tensor]) -> None:
        dev = self.device
        indices = [self._index[id(m)] for m in masters]
        states = [self._init_state(m) for m in masters]
        params = [m.to(dev, non_blocking=True) for m in masters]
        moments = {k: [s[k].to(dev, non_blocking=True) for s in states] for k in ("exp_avg", "exp_avg_sq")}
        grads = [self.grads[i] if self.grads[i].dtype == p.dtype else self.grads[i].to(p.dtype)
                 for i, p in zip(indices, params)]
        beta1, beta2 = group["betas"]
        adam(
            params, grads, moments["exp_avg"], moments["exp_avg_sq"], [], [s["step"] for s in states],
            foreach=False if dev.type == "cpu" else None, fused=True if dev.type == "cuda" else None,
            decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        for j, (i, master, state) in enumerate(zip(indices, masters, states)):
            if master.device != dev:
                master.copy_(params[j], non_blocking=True)
            for k in ("exp_avg", "exp_avg_sq"):
                if state[k].device != dev:
                    state[k].copy_(moments[k][j], non_blocking=True)
            self.module_params[i].copy_(params[j])


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in pinned (page-locked) CPU memory: device<->host copies from it run asynchronously."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin_memory_available())
    out.copy_(t)
    return out
