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
`_host_moments`), and checkpoints load into it.

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
from itertools import accumulate, chain

import torch
from torch.distributed.tensor import DTensor

from lathe.device import synchronize
from lathe.train.master import CHUNK_NUMEL, MOMENTS, StreamedAdam, numel_chunks, piece


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
        saved = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {i: {k: v for k, v in s.items() if k not in MOMENTS}
                                                         for i, s in saved.items()}})
        by_index = dict(zip(chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
                            chain.from_iterable(g["params"] for g in self.param_groups)))
        for i, s in saved.items():
            p = by_index.get(i)
            if p is None:
                continue
            state = self.state[p]
            if "step" in state:
                state["step"] = torch.as_tensor(state["step"], dtype=torch.float32, device="cpu")
            for k in MOMENTS:
                if k in s:
                    state[k] = _wrap(p, self._load_moment(p, k, s[k]))

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


MIN_BUFFER_BYTES = 1 << 26    # 64 MiB: the smallest host buffer but for the last one (see `_host_moments`)


def _host_moments(params: list[torch.Tensor]) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
    """Host memory for each parameter's moments, shaped like its local tensor, page-locked when the parameters are on
    CUDA: views of a few buffers per moment and dtype, each a power of two in size (`_pack`), rather than a tensor
    each or one buffer of all: torch's caching host allocator rounds every pinned allocation up to a power of two
    (up to twice the memory: a 72B model's 36.4 GB of fp32 shards a rank on 8 ranks would take 68.7 GB per moment in
    one buffer; packed, 36.4 GB) and keeps what is freed."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(_local(p).dtype, []).append(p)
    out: dict = {p: {} for p in params}
    for dtype, group in by_dtype.items():
        local = [_local(p) for p in group]
        pin = any(t.device.type == "cuda" for t in local)
        sizes, where = _pack([t.numel() for t in local], max(1, MIN_BUFFER_BYTES // local[0].element_size()))
        for k in MOMENTS:
            buffers = [torch.empty(n, dtype=dtype, pin_memory=pin) for n in sizes]
            for p, t, (b, offset) in zip(group, local, where):
                out[p][k] = buffers[b][offset:offset + t.numel()].view(t.shape)
    return out


def _pack(numels: list[int], min_numel: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Tensors of `numels` elements packed into buffers whose sizes are powers of two: (the buffers' sizes, each
    tensor's (buffer, offset)). Each buffer is the largest power of two not above what is left to place (or the
    smallest one the largest tensor left fits), filled largest tensor first with every tensor that fits whole: the
    binary digits of the total, about, their rests holding the small tensors. Once less than `min_numel` is left,
    one last buffer holds exactly that (its rounding up loses less than `min_numel`). Where that would take more
    memory than one buffer of the total (a few large tensors), one buffer."""
    sizes: list[int] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(numels)
    todo = sorted(range(len(numels)), key=lambda i: -numels[i])
    while todo:
        left = sum(numels[i] for i in todo)
        if left < min_numel:
            size = left
        else:
            size = max(1 << (left.bit_length() - 1), 1 << max(0, numels[todo[0]] - 1).bit_length())
        used, rest = 0, []
        for i in todo:
            if used + numels[i] <= size:
                where[i] = (len(sizes), used)
                used += numels[i]
            else:
                rest.append(i)
        sizes.append(size)
        todo = rest
    rounded = lambda n: 1 << max(0, n - 1).bit_length() if n else 0      # noqa: E731
    if sum(map(rounded, sizes)) >= rounded(sum(numels)):     # (a few large tensors): one buffer takes no more
        offsets = [0, *accumulate(numels)]
        return [offsets[-1]], [(0, offsets[i]) for i in range(len(numels))]
    return sizes, where


def _wrap(p: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """`host` (this rank's part) laid out as `p`: a DTensor with `p`'s mesh and placements for a DTensor `p`.
    DTensor.from_local would move it to the mesh's device; FSDP2 builds its offloaded shards this way too."""
    return DTensor(host, p._spec, requires_grad=False) if isinstance(p, DTensor) else host
