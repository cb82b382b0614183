"""`MasterAdamW`: AdamW over fp32 master weights of a module that computes in bf16, on one device.

This is mixed precision as FSDP2 does it (see `lathe.train.precision`), without sharding:

- the module's parameters become `param_dtype` (bf16) tensors in place: forward, backward, and the rollout
  engine (which may share them) all run on those;
- the optimizer's own parameters are the `master_dtype` (fp32) weights they were cast from — the originals,
  not a copy — on the device, or in pinned CPU memory with `offload_params` (laid out like each weight; the
  offloaded moments' host memory taken at construction in a few power-of-two buffers: `host_like`);
- a post-accumulate hook on every module parameter adds each micro-batch's bf16 gradient into a
  `reduce_dtype` (fp32) buffer on the device and frees the bf16 gradient at once, so gradient accumulation
  over micro-batches happens in fp32 and bf16 gradients never exist for the whole model at the same time;
- `step()` runs torch's own AdamW kernel (`torch.optim.adam.adam` with decoupled weight decay: fused on CUDA)
  and casts the updated masters back into the module's parameters. With `offload_params` / `offload_state`
  (AdamW's moments in pinned CPU memory) it streams the offloaded tensors through the device in chunks of at
  most `chunk_numel` elements, so the device never holds them all at once: two chunks at most, one chunk's
  copies in, the other's copies back and the kernel overlapping on three streams (`numel_chunks`,
  `StreamedAdam`: shared with `lathe.train.offloaded_adamw`, the same streaming over FSDP2 shards). A tensor
  larger than what is left of a chunk (a 7B's embedding and LM head: 545M elements each, twice `CHUNK_NUMEL`)
  is cut across chunks, as pieces: views of the flattened master, gradient, moments and module parameter; so
  the two device buffers stay two chunks' whatever the largest tensor (whole tensors, the embedding and head
  made them 12.2 GiB with `offload_params` where two chunks are 6 GiB). The per-element math is the same.

The hooks, the clipping and the masters by name are `lathe.train.master_weights.MasterWeights`', shared with the
other optimizers lathe runs over master weights. The state (`step`, `exp_avg`, `exp_avg_sq` per master) has
`torch.optim.AdamW`'s layout, so `state_dict()` checkpoints are interchangeable between offloaded and resident runs;
`torch.optim.lr_scheduler` works on it. Gradient clipping goes through `clip_grad_norm_` (the gradients are not the
masters' `.grad`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate, chain

import torch
from torch import nn
from torch.optim.adam import adam

from lathe.device import (current_stream, new_stream, pin_memory_available, record_event, stream_context, synchronize,
                          wait_event, wait_stream)
from lathe.train.master_weights import MasterWeights
from lathe.train.precision import PrecisionPolicy

CHUNK_NUMEL = 1 << 28     # elements a streamed optimizer step brings onto the device at once (two chunks in flight)


class MasterAdamW(MasterWeights, torch.optim.Optimizer):
    """AdamW on master copies of `params` (a module's trainable parameters, still in their load dtype).

    Construction casts `params` to `policy.param_dtype` in place; the tensors they held become the masters
    (converted to `policy.master_dtype` when they are not already)."""

    def __init__(self, params: Iterable[nn.Parameter], *, policy: PrecisionPolicy, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 offload_params: bool = False, offload_state: bool = False, chunk_numel: int = CHUNK_NUMEL):
        self.module_params = [p for p in params if p.requires_grad]
        if not self.module_params:
            raise ValueError("MasterAdamW: no trainable parameters")
        self.device = self.module_params[0].device
        if (offload_params or offload_state) and self.device.type != "cuda":
            raise ValueError("MasterAdamW: offloading to CPU memory needs the parameters on a CUDA device")
        self.policy, self.offload_params, self.offload_state = policy, offload_params, offload_state
        self.chunk_numel = chunk_numel
        pin = pin_memory_available()
        # host masters one storage each (not packed as the moments are: a checkpoint's save_pretrained would clone
        # every tensor that shares a storage, a transient second fp32 model in host memory)
        hosts = ([host_like([p], dtype=policy.master_dtype, pin=pin)[0] for p in self.module_params]
                 if offload_params else [None] * len(self.module_params))
        masters = [self._take_master(p, host) for p, host in zip(self.module_params, hosts)]
        super().__init__(masters, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        # the moments' host memory, taken once (`host_like`: packed buffers, laid out like each master)
        self._host = host_moments(masters, pin=pin) if self._moments_on_host else None
        self._index = {id(m): i for i, m in enumerate(masters)}
        self._hook_gradients()
        self.last_stream: StreamedAdam | None = None    # the last step's (`StreamedAdam.seconds`: its device time)

    # -- construction ---------------------------------------------------------------------------------
    def _take_master(self, p: nn.Parameter, host: torch.Tensor | None) -> torch.Tensor:
        """The master for `p` (its current tensor, in master dtype, where it lives; with `offload_params` copied into
        `host`, its place in pinned host memory); `p` becomes param_dtype."""
        master = p.detach().to(self.policy.master_dtype) if host is None else host.copy_(p.detach())
        p.data = p.data.to(self.policy.param_dtype)
        return master

    # -- the torch.optim.Optimizer interface -------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        stream = self.last_stream = StreamedAdam(self.device)
        try:
            for group in self.param_groups:
                masters = [m for m in group["params"] if self.grads[self._index[id(m)]] is not None]
                for chunk in self._chunks(masters):
                    self._step_chunk(group, chunk, stream)
        finally:               # (a failed step too: its buffers are freed, and the next step reads the write-backs)
            stream.finish()
        return None

    def state_dict(self) -> dict:
        self._wait_for_copies()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's; with the moments in host memory they are copied straight into it (torch's would first put every
        moment on its master's device: with `offload_state` alone, twice the fp32 model on the device at once)."""
        self._wait_for_copies()          # the host moments' write-backs land before they are overwritten here
        if self._host is None:
            super().load_state_dict(state_dict)
        else:
            load_without_moments(self, super().load_state_dict, state_dict, self._load_moment)
        for master in self._masters():
            state = self.state.get(master)
            if state:
                state["step"] = state["step"].to(device=self.device, dtype=torch.float32)

    def _load_moment(self, master: torch.Tensor, key: str, saved: torch.Tensor) -> torch.Tensor:
        host = self._host[key][self._index[id(master)]]
        if saved.shape != host.shape:
            raise ValueError(f"MasterAdamW.load_state_dict: {key} has shape {tuple(saved.shape)} where its master has "
                             f"{tuple(host.shape)} (a state dict of another model or parameter order)")
        return host.copy_(saved)

    # -- internals ------------------------------------------------------------------------------------------
    def _wait_for_copies(self) -> None:
        """Offloaded tensors are written back by asynchronous device-to-host copies: wait before the host reads."""
        if self.offload_params or self.offload_state:
            synchronize(self.device)

    def _chunks(self, masters: list[torch.Tensor]) -> list[list[tuple[torch.Tensor, int, int]]]:
        """Pieces `(master, start, stop)` (the flattened master's elements `[start, stop)`) by chunk: every master
        whole in one chunk when everything is on the device; else chunks of at most `chunk_numel` elements, a
        master that does not fit in the rest of a chunk cut across chunks (`numel_chunks(split=...)`). A master
        whose gradient, moments or module parameter is not contiguous (`view(-1)` needs it) is kept whole, a
        chunk of its own where it is larger, as `OffloadedAdamW` keeps its non-contiguous shards."""
        if not (self.offload_params or self.offload_state):
            return [[(m, 0, m.numel()) for m in masters]] if masters else []
        split = [self._contiguous(m) for m in masters]
        return [[(masters[i], start, stop) for i, start, stop in chunk]
                for chunk in numel_chunks([m.numel() for m in masters], self.chunk_numel, split=split)]

    def _contiguous(self, master: torch.Tensor) -> bool:
        """Whether every tensor a piece of `master` is a view of (`piece`) is contiguous."""
        i = self._index[id(master)]
        state = self._init_state(master)
        return all(t.is_contiguous() for t in (master, self.grads[i], self.module_params[i],
                                               *(state[k] for k in MOMENTS)))

    def init_state(self) -> None:
        """Every master's moments (zeros) and step now, before the first step would make them
        (`lathe.train.optim.materialize_state` says why)."""
        for master in self._masters():
            self._init_state(master)

    def _init_state(self, master: torch.Tensor) -> dict:
        state = self.state[master]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=self.device)
            for key in MOMENTS:
                state[key] = (self._host[key][self._index[id(master)]].zero_() if self._host is not None
                              else torch.zeros_like(master))
        return state

    @property
    def _moments_on_host(self) -> bool:
        """The moments live in pinned host memory with `offload_state`, and with `offload_params` alone too (by the
        host masters), in a fresh run and a resumed one alike. Pinned: the write-backs to pageable memory would
        each be synchronous."""
        return self.offload_state or self.offload_params

    def _step_chunk(self, group: dict, pieces: list[tuple[torch.Tensor, int, int]], stream: StreamedAdam) -> None:
        """AdamW over the elements `[start, stop)` of each (flattened) master of `pieces`, cast into the same
        elements of its module parameter.

        The kernel advances the step counters it is given before its bias correction, so every piece of one master
        must see the same count and the master's own counter advance once: the master's last piece (or its whole)
        gets `state["step"]`, which the kernel advances; the pieces before it a copy each (taken on the compute
        stream before the last piece's kernel, so at the count before this step). A checkpoint still has one
        `step`, `exp_avg`, `exp_avg_sq` per master."""
        indices = [self._index[id(m)] for m, _, _ in pieces]
        states = [self._init_state(m) for m, _, _ in pieces]
        masters = [piece(m, start, stop) for m, start, stop in pieces]
        grads = [piece(self.grads[i], start, stop) for i, (_, start, stop) in zip(indices, pieces)]
        moments = [{k: piece(s[k], start, stop) for k in MOMENTS} for s, (_, start, stop) in zip(states, pieces)]
        steps = [s["step"] if stop == m.numel() else s["step"].clone() for s, (m, _, stop) in zip(states, pieces)]
        params = stream.update(group, masters, grads, moments, steps, stream_params=self.offload_params,
                               stream_moments=self.offload_state)
        for i, p, (_, start, stop) in zip(indices, params, pieces):    # on the compute stream, before the next
            piece(self.module_params[i], start, stop).copy_(p)           # chunk reuses `params`


# -- streaming pieces, shared with `lathe.train.offloaded_adamw` ---------------------------------------------------
MOMENTS = ("exp_avg", "exp_avg_sq")


def numel_chunks(numels: list[int], chunk_numel: int, *,
                 split: bool | Sequence[bool] = False) -> list[list[tuple[int, int, int]]]:
    """Tensors of `numels` elements, in order, cut into groups of at most about `chunk_numel` elements: what one
    streamed step brings onto the device at once. Each group lists `(index, start, stop)`: the elements
    `[start, stop)` of tensor `index` (flattened). With `split`, a tensor that does not fit in the rest of a group is
    cut across groups (every group but the last holds `chunk_numel` exactly); without, whole tensors only (a larger
    one is a group of its own). `split` may also be one flag per tensor (whole: those that cannot be cut)."""
    chunks: list[list[tuple[int, int, int]]] = [[]]
    room = chunk_numel
    for i, n in enumerate(numels):
        cut = split if isinstance(split, bool) else split[i]
        start = 0
        while True:
            if chunks[-1] and (room <= 0 or not cut and n - start > room):
                chunks.append([])
                room = chunk_numel
            stop = n if not cut else min(n, start + room)
            chunks[-1].append((i, start, stop))
            room -= stop - start
            start = stop
            if start >= n:
                break
    return chunks if chunks[0] else []


class StreamedAdam:
    """One `step()`'s AdamW over chunks of tensors on `device`: torch's own kernel (`adam` with decoupled weight decay;
    fused on CUDA) on the compute stream, the streamed tensors copied in and back on two side streams, so that the
    copies of one chunk overlap the kernel and the copies of the others and PCIe's two directions run at once.

    Per chunk (`update`): the host-to-device copies on `h2d`, the kernel on the compute stream once they are done,
    the device-to-host write-backs on `d2h` once the kernel is done; events order them on the device, the host never
    waits (`finish` joins the side streams into the compute stream: everything queued there afterwards, and
    `synchronize`, comes after the write-backs; the next step's first copy waits for the compute stream).

    Device memory: the streamed tensors of a chunk are views of one of two buffers (`_Slot`) taken in turn, each as
    large as the largest chunk it held: the device holds at most two chunks' streamed tensors (double buffering:
    twice the largest chunk's, against one chunk when the copies ran in order on the compute stream). A chunk's
    copies into a buffer wait until the buffer's previous chunk is written back and done with on the compute stream
    (its kernel and what the caller queued there with the returned tensors before the next `update`). The buffers
    are taken on the compute stream and freed by `finish` after the join, so the caching allocator reuses them for
    the next forward as before.

    On the CPU (the tests) the streams are None and the helpers of `lathe.device` do nothing: the same code copies
    into and out of the buffers in program order. `overlap = False` (a class switch, for A/B measurements:
    bench/offload_adamw.py) does the same on an accelerator: every copy on the compute stream, in order."""

    overlap = True

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.compute = self.h2d = self.d2h = None
        self.slots = [_Slot(), _Slot()]
        self.chunks = 0
        self.started = self.finished = None    # (event or perf_counter) once something is streamed; for `seconds`

    def update(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
               steps: list[torch.Tensor], *, stream_params: bool, stream_moments: bool) -> list[torch.Tensor]:
        """One chunk of AdamW with `group`'s hyperparameters over `params` and their `states`' moments. Streamed
        tensors (`stream_params`, `stream_moments`: those kept in host memory) are copied in, updated there and
        written back (wait before the host reads them: `synchronize`); the others are updated in place. A tensor
        elsewhere than `device` is streamed too, and a streamed tensor already on `device` (a CPU test) is copied
        all the same, so the streaming runs wherever it is tested. `steps` are the kernel's step counters, on
        `device`; it increments them. Gradients are cast to the parameters' dtype where they differ. Returns the
        updated parameters on `device`: usable on the compute stream until the next `update`."""
        device = self.device
        moved_params = [stream_params or p.device != device for p in params]
        moved_moments = {k: [stream_moments or s[k].device != device for s in states] for k in MOMENTS}
        host = [p for p, m in zip(params, moved_params) if m] + [s[k] for k in MOMENTS
                                                                    for s, m in zip(states, moved_moments[k]) if m]
        slot = self.slots[self.chunks % 2]
        if self.chunks:        # the compute stream's work on the previous chunk's buffer, the caller's included
            self.slots[(self.chunks - 1) % 2].busy.append(record_event(self.compute))
        self.chunks += 1
        views, loaded = [], None
        if host:
            self._start()
            views = slot.take(host, self)
            with stream_context(self.h2d):
                for event in slot.busy:
                    wait_event(self.h2d, event)
                slot.busy = []
                for dst, src in zip(views, host):
                    _copy(dst, src)
            loaded = record_event(self.h2d)
        copies = iter(views)
        on_device = [next(copies) if m else p for p, m in zip(params, moved_params)]
        moments = {k: [next(copies) if m else s[k] for s, m in zip(states, moved_moments[k])] for k in MOMENTS}
        wait_event(self.compute, loaded)
        grads = [g.to(device=device, dtype=p.dtype) for g, p in zip(grads, on_device)]
        beta1, beta2 = group["betas"]
        adam(
            on_device, grads, moments["exp_avg"], moments["exp_avg_sq"], [], steps,
            foreach=False if device.type == "cpu" else None, fused=True if device.type == "cuda" else None,
            decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        if host:
            updated = record_event(self.compute)
            with stream_context(self.d2h):
                wait_event(self.d2h, updated)
                for src, dst in zip(views, host):
                    _copy(dst, src)
            slot.busy.append(record_event(self.d2h))
        return on_device

    def _start(self) -> None:
        """At the first streamed chunk: the side streams, which start after the compute stream's queued work (the
        gradients, and the previous step's write-backs, which its `finish` joined into it)."""
        if self.started is not None:
            return
        self.compute = current_stream(self.device)
        if self.overlap:
            self.h2d, self.d2h = new_stream(self.device), new_stream(self.device)
        wait_stream(self.h2d, self.compute)
        self.started = time.perf_counter() if self.compute is None else record_event(self.compute, timing=True)

    def finish(self) -> None:
        """The end of the step: the compute stream waits for the side streams' copies (on the device), and the
        buffers go back to the allocator."""
        if self.started is None:
            return
        wait_stream(self.compute, self.h2d)
        wait_stream(self.compute, self.d2h)
        self.slots = []
        self.finished = time.perf_counter() if self.compute is None else record_event(self.compute, timing=True)

    def seconds(self) -> float | None:
        """How long the streamed update took on the device, from its first copy to its last write-back (waits for
        it); None when nothing was streamed or before `finish`."""
        if self.finished is None:
            return None
        if isinstance(self.finished, float):
            return self.finished - self.started
        self.finished.synchronize()
        return self.started.elapsed_time(self.finished) / 1e3


class _Slot:
    """One of `StreamedAdam`'s two device buffers, in which a chunk's streamed tensors are laid out (each at an
    `ALIGN`-byte offset), and `busy`, the events after which it may be written again."""

    ALIGN = 256

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.busy: list = []

    def take(self, like: list[torch.Tensor], owner: StreamedAdam) -> list[torch.Tensor]:
        """Views shaped like `like`, the buffer grown first where they do not fit (on the compute stream, which
        first waits until the old buffer is done with; the copies into the new one wait for the compute stream)."""
        sizes = [t.numel() * t.element_size() for t in like]
        need = sum(-(-n // self.ALIGN) * self.ALIGN for n in sizes)
        if self.buffer is None or self.buffer.numel() < need:
            for event in self.busy:
                wait_event(owner.compute, event)
            self.buffer = None                       # (the old one freed before the new one is taken)
            self.buffer = torch.empty(need, dtype=torch.uint8, device=owner.device)
            self.busy = [record_event(owner.compute)]
        views, offset = [], 0
        for t, n in zip(like, sizes):
            views.append(laid_out(self.buffer[offset:offset + n].view(t.dtype), t))
            offset += -(-n // self.ALIGN) * self.ALIGN
        return views


def piece(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The flattened elements `[start, stop)` of `t`, a view (`t` itself when that is all of it)."""
    return t if start == 0 and stop == t.numel() else t.view(-1)[start:stop]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, asynchronous between pinned host memory and a device (a seam for the tests' stream log)."""
    dst.copy_(src, non_blocking=True)


def laid_out(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`flat` (`like.numel()` elements) as a tensor of `like`'s shape and, where `like` is dense but not contiguous
    (a weight stored transposed), its strides: CUDA's fused AdamW requires a parameter, its gradient and its moments
    to share their layout, and a gradient takes its parameter's."""
    if like.is_contiguous() or not dense(like):
        return flat.view(like.shape)
    return flat.as_strided(like.shape, like.stride())


def dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill `t.numel()` consecutive places, in some order of its dimensions."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


MIN_BUFFER_BYTES = 1 << 26    # 64 MiB: the smallest host buffer but for the last one (see `host_like`)


def host_like(tensors: list[torch.Tensor], *, pin: bool, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Host memory for one tensor like each of `tensors` (its shape and layout: `laid_out`; in `dtype`, by default
    its own), page-locked with `pin`: views of a few buffers per dtype, each a power of two in size (`pack`), rather
    than a tensor each or one buffer of all: torch's caching host allocator rounds every pinned allocation up to a
    power of two (up to twice the memory: a 7B's 2.2 GB embedding in 4 GB; a 72B model's 36.4 GB of fp32 shards a
    rank on 8 ranks would take 68.7 GB per moment in one buffer; packed, 36.4 GB) and keeps what is freed."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(dtype or t.dtype, []).append(i)
    for kind, members in by_dtype.items():
        numels = [tensors[i].numel() for i in members]
        sizes, where = pack(numels, max(1, MIN_BUFFER_BYTES // kind.itemsize))
        buffers = [torch.empty(n, dtype=kind, pin_memory=pin) for n in sizes]
        for i, n, (b, offset) in zip(members, numels, where):
            out[i] = laid_out(buffers[b][offset:offset + n], tensors[i])
    return out


def pack(numels: list[int], min_numel: int) -> tuple[list[int], list[tuple[int, int]]]:
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


def host_moments(masters: list[torch.Tensor], *, pin: bool) -> dict[str, list[torch.Tensor]]:
    """`MasterAdamW`'s host memory for the moments of `masters`: {moment: one tensor like each master}."""
    return {k: host_like(masters, pin=pin) for k in MOMENTS}


def load_without_moments(opt: torch.optim.Optimizer, load: Callable[[dict], None], state_dict: dict,
                         take: Callable[[torch.Tensor, str, torch.Tensor], torch.Tensor]) -> None:
    """`load(state_dict)` (torch's `Optimizer.load_state_dict`, which puts every state tensor on its parameter's
    device first) with the moments left out, then each saved moment kept as `take(param, key, saved)` returns it
    (copied into the optimizer's host memory)."""
    saved = state_dict["state"]
    load({**state_dict, "state": {i: {k: v for k, v in s.items() if k not in MOMENTS} for i, s in saved.items()}})
    by_index = dict(zip(chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
                        chain.from_iterable(g["params"] for g in opt.param_groups)))
    for i, s in saved.items():
        p = by_index.get(i)
        for k in MOMENTS:
            if p is not None and k in s:
                opt.state[p][k] = take(p, k, s[k])
