"""Weight sync between two pools of processes: the trainer's rank 0 broadcasts the weights to the rollout replicas.

verl's checkpoint engine (`nccl` backend). In fully-asynchronous training the trainer ranks (FSDP2, in their own
default process group) push each update to rollout ranks that run an inference engine in other processes, with
their own default process group or none. The two pools share no process group, so the sync builds its own
communicator straight from a `TCPStore` and a backend object (`ProcessGroupNCCL` on CUDA, `ProcessGroupGloo` on
CPU): a `SyncGroup`, which never touches `torch.distributed`'s default group. Rank 0 of it is the sender (the
trainer's rank 0), ranks 1..R the receivers (one per rollout replica; with tensor-parallel replicas one group per
tensor-parallel position, each sending that position's slices: `lathe.workers.reshard`).

Both sides derive the same plan from the same `TensorMeta` list (`metas_of` on the trainer, sent once to the
replicas, e.g. through Ray): consecutive tensors packed into buckets of at most `bucket_bytes` (a larger tensor
goes alone), each tensor at a 256-byte aligned offset of a flat uint8 buffer. Per bucket the sender casts each
tensor to its planned dtype and copies it into the buffer, and broadcasts the buffer; a receiver hands
`(name, view)` pairs into its buffer to a `consume` callback, which copies them into the model. Bytes are copied,
never computed on, so the weights arrive bit-equal (to the sender's values cast to the planned dtype).

Both sides double-buffer: two buffers alternate, so packing (sender) or consuming (receiver) bucket k overlaps
the asynchronous broadcast of its neighbour; a buffer's previous broadcast is waited on before it is reused.
Every wait has a deadline (`timeout_s`) past which it names the ranks that did not reach the bucket (each rank
marks in the store the bucket it posts), and a side that fails (a tensor that does not match the plan, a
`consume` that raises) posts its error in the store, so the others raise it within a second instead of hanging.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lathe import device as accel

ALIGN = 256                 # bytes: every tensor's offset in a bucket buffer is a multiple of this
_ERROR_KEY = "error"        # store key where a failed rank posts its error
_POLL_MAX_S = 2e-4          # longest sleep between two completion checks of a broadcast
_ERROR_CHECK_S = 1.0        # how often a long wait looks for another rank's error in the store
_BACKEND_TIMEOUT = re.compile(r"time(d)?[ -]?out", re.IGNORECASE)   # a backend's own timeout, as Gloo/NCCL word it
_ABANDONED: list = []       # failed backends, never destroyed (see SyncGroup.close)


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to know of one tensor: its name, shape and (planned) dtype."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def metas_of(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> list[TensorMeta]:
    """The metas of `named_tensors`, in order; floating tensors take `dtype` (the rollout's) when given, others
    keep their own. A DTensor (FSDP2) gives its full, unsharded shape."""
    return [TensorMeta(name, tuple(t.shape), dtype if dtype is not None and t.is_floating_point() else t.dtype)
            for name, t in named_tensors]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def bucket_plan(metas: list[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive tensors, in order, grouped into buckets of at most max(bucket_bytes, largest tensor) bytes
    (tensors at ALIGN-aligned offsets, see `bucket_layout`); a tensor larger than `bucket_bytes` is alone."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: it must be a positive number of bytes (e.g. 512 << 20)")
    plan: list[list[TensorMeta]] = []
    used = 0
    for meta in metas:
        if plan and _align(used) + meta.nbytes <= bucket_bytes:
            plan[-1].append(meta)
            used = _align(used) + meta.nbytes
        else:
            plan.append([meta])
            used = meta.nbytes
    return plan


def bucket_layout(bucket: list[TensorMeta]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the bucket's buffer (multiples of ALIGN) and the bucket's size in bytes."""
    offsets, end = [], 0
    for meta in bucket:
        offsets.append(_align(end))
        end = offsets[-1] + meta.nbytes
    return offsets, end


def check_tensor(meta: TensorMeta, name: str, tensor: torch.Tensor, index: int) -> None:
    """Raise a ValueError naming the tensor when (name, tensor), the `index`-th one sent, does not match the plan."""
    fix = "compute the metas (metas_of) from the same model and send them to the receivers again"
    if name != meta.name:
        raise ValueError(f"send_weights: tensor #{index} is {name!r} but the plan expects {meta.name!r} there: the "
                         f"weights must come in the order metas_of saw them; {fix}")
    if tuple(tensor.shape) != meta.shape:
        raise ValueError(f"send_weights: {name!r} has shape {tuple(tensor.shape)} but the plan expects "
                         f"{meta.shape}; {fix}")
    if tensor.is_floating_point() != meta.dtype.is_floating_point:
        raise ValueError(f"send_weights: {name!r} is {tensor.dtype} but the plan expects {meta.dtype} (a cast "
                         f"between floating and integer types would change its values); {fix}")


class SyncGroup:
    """A communicator of `world_size` processes that is not (and needs no) default process group.

    Rank 0 (the sender) hosts the TCPStore at host:port; every rank must build its SyncGroup with the same host,
    port and world size within `timeout_s`. The backend follows `device`: NCCL on CUDA (one device per process),
    Gloo on CPU. `label` (e.g. the tensor-parallel position of a resharding sync's group) goes into its errors.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, *, device: torch.device,
                 timeout_s: float = 600.0, label: str = ""):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"SyncGroup: rank={rank}, world_size={world_size}: the rank must be in "
                             f"[0, world_size) (rank 0 is the sender, 1..world_size-1 the receivers)")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = accel.current_device("cuda")
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"SyncGroup: device={device}: only cuda (NCCL) and cpu (Gloo) are supported")
        self.host, self.port, self.rank, self.world_size, self.device = host, port, rank, world_size, device
        self.timeout_s = float(timeout_s)
        self._failed = False
        self._sync = 0          # send/receive_weights calls so far
        self._buckets: dict[int, int | None] = {}      # id of a pending broadcast's Work -> its bucket
        self._where = f"SyncGroup at {host}:{port} (rank {rank}, world size {world_size}{', ' * bool(label)}{label})"
        timeout = timedelta(seconds=timeout_s)
        self._store = self._connect(timeout)
        self.store = dist.PrefixStore("lathe_sync/", self._store)
        self._join(timeout)
        backend_store = dist.PrefixStore("lathe_sync/backend/", self._store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            options.is_high_priority_stream = False
            self.backend = dist.ProcessGroupNCCL(backend_store, rank, world_size, options)
            if hasattr(self.backend, "eager_connect_single_device"):   # build the communicator now, not mid-sync
                with accel.use_device(device):
                    self.backend.eager_connect_single_device(device)
        else:
            self.backend = dist.ProcessGroupGloo(backend_store, rank, world_size, timeout=timeout)

    def _connect(self, timeout: timedelta) -> dist.TCPStore:
        try:
            return dist.TCPStore(self.host, self.port, self.world_size, is_master=self.rank == 0, timeout=timeout,
                                 wait_for_workers=False)
        except (RuntimeError, TimeoutError) as e:
            if self.rank == 0:
                raise RuntimeError(f"{self._where}: the sender could not open the store on port {self.port} "
                                   f"({e}); pick a free port") from e
            raise TimeoutError(f"{self._where}: no store at {self.host}:{self.port} after {self.timeout_s:g} s: "
                               f"rank 0 (the sender, on the trainer) did not join; start its SyncGroup with the "
                               f"same host and port ({e})") from e

    def _join(self, timeout: timedelta) -> None:
        """Wait until every rank has reached its SyncGroup; say which did not."""
        keys = [f"joined/{r}" for r in range(self.world_size)]
        self.store.set(keys[self.rank], "1")
        try:
            self.store.wait(keys, timeout)
        except (RuntimeError, TimeoutError) as e:
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            side = ("the sender (rank 0, on the trainer)" if missing == [0]
                    else f"receiver rank(s) {missing} (rollout replicas {[r - 1 for r in missing]})")
            raise TimeoutError(f"{self._where}: {side} did not join within {self.timeout_s:g} s; every rank must "
                               f"build a SyncGroup with host {self.host!r}, port {self.port} and world size "
                               f"{self.world_size}") from e

    def broadcast(self, tensor: torch.Tensor, src: int = 0, bucket: int | None = None):
        """Broadcast `tensor` (contiguous, on `device`) from rank `src`, asynchronously: returns the Work. `bucket`:
        its index in this sync, marked in the store first (a rank whose wait for it times out names the ranks that
        never reached it)."""
        if bucket is not None:
            self.store.set(f"at/{self.rank}", f"{self._sync} {bucket}")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        work = self.backend.broadcast([tensor], opts)
        self._buckets[id(work)] = bucket
        return work

    def wait(self, work) -> None:
        """Block until `work` is done (then order the current stream after it), at most `timeout_s`; raise another
        rank's posted error as soon as it appears."""
        start = now = time.monotonic()
        next_check, delay = start + _ERROR_CHECK_S, 1e-5
        bucket = self._buckets.pop(id(work), None)
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_check:
                self.raise_if_failed()
                next_check = now + _ERROR_CHECK_S
            if now - start > self.timeout_s:
                raise self._timed_out(bucket)
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)
        try:
            work.wait()
        except Exception as e:
            self.raise_if_failed()   # a peer's own error says more than the broken connection it left behind
            if _BACKEND_TIMEOUT.search(str(e)):     # the backend's own timeout fired first (Gloo: "Application
                raise self._timed_out(bucket) from e    # timeout caused pair closure", "Timed out waiting 1000ms for
                                                        # send operation"): say who did not answer all the same
            raise

    def _timed_out(self, bucket: int | None) -> TimeoutError:
        return TimeoutError(f"{self._where}: {self._laggards(bucket)} within {self.timeout_s:g} s (it died, or is "
                            f"not calling send/receive_weights)")

    def _laggards(self, bucket: int | None) -> str:
        """Who did not reach `bucket` of this sync, by the ranks' marks in the store."""
        what = f"bucket {bucket} of weight sync #{self._sync}" if bucket is not None else "a broadcast"
        try:
            marks = [self.store.get(f"at/{r}").decode() if self.store.check([f"at/{r}"]) else "0 -1"
                     for r in range(self.world_size)]
        except Exception:       # the store (rank 0) is gone
            marks = None
        if bucket is None or marks is None:
            return f"{what} did not finish: a rank stopped taking part"
        behind = [r for r, m in enumerate(marks) if tuple(map(int, m.split())) < (self._sync, bucket)]
        late = [r for r in behind if r]
        who = ["the sender (rank 0, the trainer's rank 0)"] * (0 in behind) + [
            f"receiver rank(s) {late} (rollout replicas {[r - 1 for r in late]})"] * bool(late)
        return f"{' and '.join(who) or 'no rank (every one posted it)'} did not reach {what}"

    def synchronize(self) -> None:
        accel.synchronize(self.device)

    def begin_sync(self) -> None:
        """Count one more send/receive_weights call; refuse it once the group has failed."""
        self._sync += 1
        if self._failed:
            raise RuntimeError(f"{self._where}: a weight sync failed earlier on this rank; close this SyncGroup "
                               f"and build a new one on every rank")
        self.raise_if_failed()

    def fail(self, message: str) -> None:
        """Post this rank's error (the first one posted stays) so that the other ranks raise it instead of
        waiting out the timeout."""
        self._failed = True
        try:
            self.store.compare_set(_ERROR_KEY, "", f"{self._sync}\nsync #{self._sync} on rank {self.rank}: {message}")
        except Exception:   # the store is gone too: the others will time out
            pass

    def raise_if_failed(self) -> None:
        """Raise another rank's posted error if it happened in this rank's current sync or an earlier one (a
        sender can run a sync ahead of its receivers: their current sync's data is already on its way)."""
        try:
            posted = self.store.check([_ERROR_KEY]) and self.store.get(_ERROR_KEY).decode()
        except Exception:
            return           # the store (rank 0) is gone: the broadcast's own error or the timeout will tell
        if posted:
            sync, _, message = posted.partition("\n")
            if int(sync) <= self._sync:
                self._failed = True
                raise RuntimeError(f"{self._where}: the weight sync failed: {message}; close this SyncGroup and "
                                   f"build a new one on every rank")

    def close(self) -> None:
        """Shut the backend down, or abort it after a failure; idempotent. Rank 0's close also closes the store.
        After a failure a broadcast may still be pending (a receiver waiting for a bucket that never comes): Gloo's
        destructor would join its thread, blocked until `timeout_s`, so a failed backend is kept, aborted, for the
        life of the process instead of destroyed."""
        backend, self.backend = getattr(self, "backend", None), None
        if backend is not None:
            try:
                backend.abort() if self._failed else backend.shutdown()
            except Exception:
                pass
            if self._failed:
                _ABANDONED.append(backend)
        self._store = self.store = None


def _buffers(group: SyncGroup, plan: list[list[TensorMeta]]) -> list[torch.Tensor]:
    capacity = max(bucket_layout(b)[1] for b in plan)
    return [torch.empty(capacity, dtype=torch.uint8, device=group.device) for _ in range(min(2, len(plan)))]


def _stats(metas: list[TensorMeta], start: float, plan: list) -> dict[str, float]:
    return {"bytes": float(sum(m.nbytes for m in metas)), "seconds": time.perf_counter() - start,
            "buckets": float(len(plan))}


class BucketSender:
    """Rank 0's side of one sync, fed one tensor at a time (`push`): each tensor is cast and copied into the
    current bucket's buffer, and a full bucket is broadcast asynchronously while the next one is packed into the
    other buffer. Several senders (one per group) can be fed in turn: their broadcasts overlap. The plan's last
    bucket goes at `finish` (once the weights ran out: a tensor too many fails the sync before the receivers hold
    it all), which then waits for every broadcast and returns the stats."""

    def __init__(self, group: SyncGroup, metas: list[TensorMeta], bucket_bytes: int):
        if group.rank != 0:
            raise ValueError(f"send_weights on rank {group.rank}: only rank 0 (the trainer's rank 0) sends; "
                             f"receivers call receive_weights")
        group.begin_sync()
        self.group, self.metas, self.start = group, metas, time.perf_counter()
        self.plan = bucket_plan(metas, bucket_bytes)
        self.layouts = [bucket_layout(b) for b in self.plan]
        self.buffers = _buffers(group, self.plan) if self.plan else []
        self.pending: list = [None, None]
        self.bucket = self.slot = 0         # the bucket being packed, its place in it
        self.count = 0                      # tensors pushed so far

    def push(self, name: str, tensor: torch.Tensor) -> None:
        """Copy the next tensor of the plan (cast to its planned dtype); broadcast its bucket once it is full (the
        last one: at `finish`)."""
        try:
            if self.count == len(self.metas):
                raise one_more(name, len(self.metas))
            k, bucket = self.bucket, self.plan[self.bucket]
            meta, offset = bucket[self.slot], self.layouts[k][0][self.slot]
            check_tensor(meta, name, tensor, self.count)
            buffer = self.buffers[k % 2]
            if self.slot == 0 and self.pending[k % 2] is not None:     # the buffer's previous broadcast
                self.group.wait(self.pending[k % 2])
                self.pending[k % 2] = None
            buffer[offset:offset + meta.nbytes].view(meta.dtype).view(meta.shape).copy_(tensor.detach())
            self.count += 1
            self.slot += 1
            if self.slot == len(bucket) and k + 1 < len(self.plan):
                self._broadcast()
        except BaseException as e:
            self.fail(e)
            raise

    def finish(self) -> dict[str, float]:
        """Wait for every broadcast (ValueError when the plan expected more tensors); the stats."""
        try:
            if self.count < len(self.metas):
                meta = self.plan[self.bucket][self.slot]
                raise ValueError(f"send_weights: the weights ran out before {meta.name!r} (tensor #{self.count} of "
                                 f"the plan): the iterator must yield every tensor of the metas")
            if self.plan:
                self._broadcast()
            for work in self.pending:
                if work is not None:
                    self.group.wait(work)
            self.group.synchronize()
        except BaseException as e:
            self.fail(e)
            raise
        return _stats(self.metas, self.start, self.plan)

    def _broadcast(self) -> None:
        k = self.bucket
        self.pending[k % 2] = self.group.broadcast(self.buffers[k % 2][:self.layouts[k][1]], src=0, bucket=k)
        self.bucket, self.slot = k + 1, 0

    def fail(self, e: BaseException) -> None:
        self.group.fail(f"{type(e).__name__}: {e}")


def send_weights(group: SyncGroup, named_tensors: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta],
                 *, bucket_bytes: int) -> dict[str, float]:
    """Rank 0: broadcast `named_tensors` (consumed lazily, one tensor at a time) per the plan of `metas`.

    Each tensor must match its meta's name and shape (ValueError naming it otherwise); it is cast to the meta's
    dtype. Returns {"bytes": payload bytes, "seconds": wall time until every broadcast is done, "buckets"}.
    """
    sender = BucketSender(group, metas, bucket_bytes)
    try:
        for name, tensor in named_tensors:
            sender.push(name, tensor)
    except BaseException as e:          # the iterator's own error too (push posts its own)
        sender.fail(e)
        raise
    return sender.finish()


def one_more(name: str, count: int) -> ValueError:
    return ValueError(f"send_weights: {name!r} is one tensor more than the {count} of the plan; compute the metas "
                      f"(metas_of) from the same model and send them to the receivers again")


def receive_weights(group: SyncGroup, metas: list[TensorMeta], *, bucket_bytes: int,
                    consume: Callable[[list[tuple[str, torch.Tensor]]], None]) -> dict[str, float]:
    """Ranks >= 1: receive every bucket of the plan of `metas` and call `consume([(name, view), ...])` on it.

    The views (meta.shape, meta.dtype, on group.device) point into a reused buffer and are valid only during the
    call: `consume` copies them into the model (on the current stream, on CUDA). The next bucket is already being
    received while `consume` runs. Returns the same stats as `send_weights`.
    """
    if group.rank == 0:
        raise ValueError("receive_weights on rank 0: rank 0 is the sender; it calls send_weights")
    group.begin_sync()
    start = time.perf_counter()
    plan = bucket_plan(metas, bucket_bytes)
    layouts = [bucket_layout(b) for b in plan]
    pending: list = [None, None]
    try:
        buffers = _buffers(group, plan) if plan else []

        def post(k: int) -> None:
            pending[k % 2] = group.broadcast(buffers[k % 2][:layouts[k][1]], src=0, bucket=k)

        if plan:
            post(0)
        for k, bucket in enumerate(plan):
            if k + 1 < len(plan):
                post(k + 1)    # its buffer held bucket k-1, consumed already
            group.wait(pending[k % 2])
            pending[k % 2] = None
            buffer = buffers[k % 2]
            consume([(m.name, buffer[o:o + m.nbytes].view(m.dtype).view(m.shape))
                     for m, o in zip(bucket, layouts[k][0])])
        group.synchronize()
    except BaseException as e:
        group.fail(f"{type(e).__name__}: {e}")
        raise
    return _stats(metas, start, plan)
