"""`OffloadedAdamW`: AdamW whose moments live in host memory while the parameters stay on the device: verl's
`fsdp_config.optimizer_offload` without `param_offload` on several devices (FSDP2).

FSDP2 offloads all or nothing (`CPUOffloadPolicy`: shards, gradients and optimizer state in host memory, and the
step on the CPU). This keeps each rank's parameter shards and gradients on the device and moves only AdamW's two
moments -- twice the fp32 shards, the largest part of a trainer's memory -- into pinned host memory: each rank holds
its own shards' moments, and `step()` streams them through the device in chunks of at most `chunk_numel` elements
(a shard larger than that is cut across chunks), running torch's own AdamW kernel on the local tensors of the
parameters, gradients and moments: `lathe.train.master.StreamedAdam`, the streaming `MasterAdamW` does on one
device (the copies in and back on side streams, overlapping each other and the kernel; two chunks on the device at
most). The host memory is taken once, at construction (a few buffers per moment, of power-of-two sizes:
`lathe.train.master.host_like`), and checkpoints load into it.

It is a `torch.optim.AdamW` (the same parameter-group defaults) whose state has the same layout: per parameter,
`step` (a float32 CPU scalar) and `exp_avg` / `exp_avg_sq` placed like the parameter (DTensors for FSDP2 shards, their
local tensors in host memory, as FSDP2's own offload keeps its shards). `torch.distributed.checkpoint` saves and loads
it by parameter name like the resident optimizer's, so a checkpoint written with offload resumes without it and the
other way round. The gradients are the parameters' `.grad`, so gradient clipping
(`lathe.train.parallel.clip_grad_norm_`) does not change.

On a CPU (the tests) the moments are ordinary host tensors, streamed all the same: copied in, updated, copied back.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from lathe.device import synchronize
from lathe.train.master import CHUNK_NUMEL, MOMENTS, StreamedAdam, host_like, load_without_moments, numel_chunks, piece


class OffloadedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW(params, lr, betas, eps, weight_decay)` (decoupled weight decay), moments in host memory,
    streamed through the parameters' device `chunk_numel` elements at a time."""

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, chunk_numel: int = CHUNK_NUMEL):
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.chunk_numel = chunk_numel
        self._host = _host_moments([p for g in self.param_groups for p in g["params"]])
        self.last_stream: StreamedAdam | None = None    # the last step's (`StreamedAdam.seconds`: its device time)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_host"):         # after construction: host memory for the new group's moments
            self._host.update(_host_moments(self.param_groups[-1]["params"]))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        streams: dict[torch.device, StreamedAdam] = {}     # one per device (a rank has one)
        try:
            for group in self.param_groups:
                if group.get("amsgrad") or group.get("maximize"):
                    raise ValueError("OffloadedAdamW: amsgrad and maximize are not supported (a loaded state dict set "
                                     "them); use torch.optim.AdamW (fsdp_config.optimizer_offload=false)")
                params = [p for p in group["params"] if p.grad is not None]
                local = [_local(p) for p in params]
                split = all(t.is_contiguous() and _local(p.grad).is_contiguous() for t, p in zip(local, params))
                touched = set()
                for chunk in numel_chunks([t.numel() for t in local], self.chunk_numel, split=split):
                    self._step_chunk(group, [(params[i], start, stop) for i, start, stop in chunk], streams)
                    touched.update(i for i, _, _ in chunk)
                for i in touched:                  # the kernel counted on device copies of the step
                    self.state[params[i]]["step"] += 1
        finally:               # (a failed step too: its buffers are freed, and the next step reads the write-backs)
            for stream in streams.values():
                stream.finish()
            self.last_stream = next(iter(streams.values()), None)
        return loss

    def _step_chunk(self, group: dict, pieces: list[tuple[torch.Tensor, int, int]],
                    streams: dict[torch.device, StreamedAdam]) -> None:
        """AdamW over the elements `[start, stop)` of each (flattened) parameter of `pieces`."""
        states = [self._init_state(p) for p, _, _ in pieces]
        params = [piece(_local(p), start, stop) for p, start, stop in pieces]
        grads = [piece(_local(p.grad), start, stop) for p, start, stop in pieces]
        moments = [{k: piece(_local(s[k]), start, stop) for k in MOMENTS}
                   for s, (_, start, stop) in zip(states, pieces)]
        device = params[0].device
        steps = [torch.full((), float(s["step"]), dtype=torch.float32, device=device) for s in states]
        if device not in streams:
            streams[device] = StreamedAdam(device)
        stream = streams[device]
        stream.update(group, params, grads, moments, steps, stream_params=False, stream_moments=True)

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for k in MOMENTS:
                state[k] = _wrap(p, self._host[p][k].zero_())
        return state

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's, once the asynchronous copies of the moments back to host memory are done."""
        self._wait_for_copies()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that the moments go straight into this optimizer's host memory (torch's would first put
        every moment on its parameter's device: the memory offload saves); `torch.distributed.checkpoint` loads into
        that memory itself, which is then kept as it is."""
        self._wait_for_copies()
        load_without_moments(self, super().load_state_dict, state_dict,
                             lambda p, k, saved: _wrap(p, self._load_moment(p, k, saved)))
        for state in self.state.values():
            if "step" in state:
                state["step"] = torch.as_tensor(state["step"], dtype=torch.float32, device="cpu")

    def _load_moment(self, p: torch.Tensor, k: str, value: torch.Tensor) -> torch.Tensor:
        host, src = self._host[p][k], _local(value)
        if src.shape != host.shape:
            raise ValueError(f"OffloadedAdamW.load_state_dict: {k} has shape {tuple(src.shape)} where this rank's "
                             f"shard of its parameter has {tuple(host.shape)} (a state dict of another sharding: load "
                             "it through torch.distributed.checkpoint, which reshards)")
        if src.device != host.device or src.data_ptr() != host.data_ptr():
            host.copy_(src)
        return host

    def _wait_for_copies(self) -> None:
        devices = {_local(p).device for g in self.param_groups for p in g["params"]}
        for device in devices:
            synchronize(device)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: in-place updates reach the DTensor); a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _host_moments(params: list[torch.Tensor]) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
    """Host memory for each parameter's moments, laid out like its local tensor, page-locked when the parameters are
    on CUDA: `lathe.train.master.host_like`'s packed buffers (torch's caching host allocator rounds every pinned
    allocation up to a power of two)."""
    local = [_local(p) for p in params]
    pin = any(t.device.type == "cuda" for t in local)
    hosts = {k: host_like(local, pin=pin) for k in MOMENTS}
    return {p: {k: hosts[k][i] for k in MOMENTS} for i, p in enumerate(params)}


def _wrap(p: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """`host` (this rank's part) laid out as `p`: a DTensor with `p`'s mesh and placements for a DTensor `p`.
    DTensor.from_local would move it to the mesh's device; FSDP2 builds its offloaded shards this way too."""
    return DTensor(host, p._spec, requires_grad=False) if isinstance(p, DTensor) else host
