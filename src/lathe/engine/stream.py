"""Streamed requests and partial rollout for `LatheEngine` (fully asynchronous RL).

    engine.add_request("q17", prompts, SamplingParams(n=8, seed=0), first_index=136)   # at any time
    while engine.has_unfinished_requests():
        engine.step()
        for request_id, out in engine.pop_finished():       # each request once, when all its samples are done
            ...
    engine.interrupt()                                  # weight sync: in-flight samples keep their tokens
    engine.load_weights(named_tensors, version=3)       # ... and continue under the new weights

A request (prompts, each sampled `n` times) becomes sequences exactly as `generate` makes them (same seeds for the
same `first_index`), so a streamed request samples what one `generate` call for it samples, whenever it is added and
whatever runs beside it (up to the last bits of batch-dependent logits, see `lathe.engine.llm_engine`).

Partial rollout (verl's `async_training.partial_rollout`): `interrupt()` resolves the step still on the device, then
preempts every sequence that holds KV blocks by recompute (`Scheduler.preempt_all`): its tokens and log-probs stay,
its KV goes. `load_weights` then copies new weights in, forgets every cached prefix and the image embeddings of the
waiting prompts (VL models), and bumps `weight_version`; the continuation's prefill encodes its images again with the
new vision tower and recomputes prompt + generated tokens under the new weights. Each output token keeps the log-prob
it was sampled with; `RolloutOutput.versions` says which weights sampled which tokens.

Admission statistics (`Scheduler.new_call`): a request that finds the engine idle starts them afresh, as a
`generate` call does; while requests keep arriving they carry over (response lengths seen so far, and the
reservation boost of memory preemptions; weight-sync interrupts do not raise it).

`generate` refuses to run while streamed requests are unfinished (it would drive them, and they it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lathe.engine.multimodal import drop_embeddings
from lathe.engine.sequence import PENDING, Sequence, SequenceStatus
from lathe.engine.speculative import spec_metrics
from lathe.generation import RolloutOutput, SamplingParams


class _Request:
    __slots__ = ("request_id", "seqs", "versions", "remaining", "num_interrupted")

    def __init__(self, request_id, seqs: list[Sequence], version: int):
        self.request_id, self.seqs = request_id, seqs
        self.versions = [[(version, 0)] for _ in seqs]
        self.remaining = sum(not s.is_finished for s in seqs)
        self.num_interrupted = 0

    def on_host(self) -> bool:
        """Every sample's last token has reached the host (none is a `PENDING` placeholder)."""
        return all(s.token_ids[-1] != PENDING for s in self.seqs)

    def output(self, routing=None) -> RolloutOutput:
        """The request's `RolloutOutput`; with `routing` (the engine's `RoutingRecorder`: routing replay R3) each
        sample's recorded choices too, taken now from a sample whose blocks the engine still holds (a hybrid model's
        parked turn, `park_finished`)."""
        routed = None
        if routing is not None:
            routed = [(routing.take(s) if getattr(s, "routed_experts", None) is None else s.routed_experts).cpu()
                      for s in self.seqs]
            for s in self.seqs:
                s.routed_experts = None
        return RolloutOutput(
            token_ids=[s.output_token_ids for s in self.seqs], logprobs=[list(s.logprobs) for s in self.seqs],
            finish_reasons=[s.finish_reason for s in self.seqs], routed_experts=routed,
            metrics={"rollout/num_preemptions": sum(s.num_preemptions for s in self.seqs),
                     "rollout/num_interrupted": self.num_interrupted,
                     "rollout/prefix_hit_tokens": sum(s.num_prefix_hit_tokens for s in self.seqs),
                     **(spec_metrics(self.seqs) if any(s.spec_verifies for s in self.seqs) else {})},
            versions=[list(v) for v in self.versions])


class RequestTracker:
    """Which request each unfinished sequence belongs to, and the requests whose sequences all finished, in the
    order they finished (`Scheduler.on_finish`). A request is returned once its last tokens are on the host."""

    def __init__(self):
        self.requests: dict[Any, _Request] = {}              # added, not yet returned
        self.owner: dict[Sequence, tuple[_Request, int]] = {}  # unfinished sequence -> (request, sample)
        self.done: list[_Request] = []                      # all sequences finished, in finish order
        self.routing = None                                 # the engine's RoutingRecorder (routing replay R3)

    def check_new(self, request_id) -> None:
        if request_id in self.requests:
            raise ValueError(f"add_request: request_id {request_id!r} is already in the engine (added and not yet "
                             "returned by pop_finished); request ids must be unique among unreturned requests")

    def add(self, request_id, seqs: list[Sequence], version: int) -> None:
        self.check_new(request_id)
        req = _Request(request_id, seqs, version)
        self.requests[request_id] = req
        for j, s in enumerate(seqs):
            if not s.is_finished:
                self.owner[s] = (req, j)
        if req.remaining == 0:
            self.done.append(req)

    def on_finish(self, seq: Sequence) -> None:
        entry = self.owner.pop(seq, None)
        if entry is None:               # a `generate` call's sequence
            return
        req = entry[0]
        req.remaining -= 1
        if req.remaining == 0:
            self.done.append(req)

    def interrupted(self, seq: Sequence) -> None:
        entry = self.owner.get(seq)
        if entry is not None:
            entry[0].num_interrupted += 1

    def new_version(self, version: int) -> None:
        """Each unfinished sequence samples its next token with weights `version`."""
        for seq, (req, j) in self.owner.items():
            spans, start = req.versions[j], seq.num_output_tokens
            if spans[-1][1] == start:           # nothing sampled under the previous version
                spans[-1] = (version, start)
            elif spans[-1][0] != version:
                spans.append((version, start))

    def pop_ready(self) -> list[tuple[Any, RolloutOutput]]:
        ready = [r for r in self.done if r.on_host()]
        if not ready:
            return []
        self.done = [r for r in self.done if not r.on_host()]
        for r in ready:
            del self.requests[r.request_id]
        return [(r.request_id, r.output(self.routing)) for r in ready]


class StreamingMixin:
    """`LatheEngine`'s streaming interface (see the module docstring); state lives in `self._requests`."""

    weight_version: int
    _requests: RequestTracker

    def _init_streaming(self) -> None:
        self.weight_version = 0
        self._requests = RequestTracker()
        self._requests.routing = self.routing
        self.scheduler.on_finish = self._requests.on_finish
        # a hybrid model keeps a finished streamed sequence's KV and states for the prompt that continues it (the
        # agent loop's next turn), as prefix caching does for the other families (`StateBlockManager`)
        self.park_finished = self.states is not None

    def add_request(self, request_id, prompt_token_ids: list[list[int]], params: SamplingParams, *,
                    first_index: int = 0, multi_modal_inputs: list[dict | None] | None = None) -> None:
        """Queue `params.n` samples of each prompt (prompt-major), seeded as `generate(..., first_index=)` seeds
        them; callable between any two `step()` calls. `request_id`: any hashable, unique among the requests
        not yet returned by `pop_finished`. `multi_modal_inputs` (VL models): each prompt's images, as `generate`
        takes them (encoded here, once for the prompt's `n` samples), or a `prepare_images` result of a prompt that
        this one continues (the agent loop's later turns: encoded once, the tokens after it are text). With
        data-parallel attention (`dp`) the replicas must step in lockstep: a replica with nothing to run calls
        `dp_idle` while another steps (the agent loop's `_run` agrees on it each step)."""
        self._requests.check_new(request_id)
        try:
            seqs = self._make_sequences(prompt_token_ids, params, first_index, multi_modal_inputs)
        except ValueError as e:
            raise ValueError(f"add_request {request_id!r}: {e}") from None
        for seq in seqs:
            seq.parkable = self.park_finished     # (an image prompt's turns too: parked by tokens and images)
        if params.max_tokens <= 0:
            for seq in seqs:
                seq.finish_reason, seq.status = "length", SequenceStatus.FINISHED
        elif seqs:
            idle, waiting = not self.has_unfinished_requests(), len(self.scheduler.waiting)
            try:
                for seq in seqs:
                    self.scheduler.add(seq)      # raises when a sequence can never fit in the cache
            except ValueError:
                while len(self.scheduler.waiting) > waiting:     # the request is refused whole: nothing changed
                    self.scheduler.waiting.pop()
                raise
            if idle:
                self.scheduler.new_call()        # an idle engine starts its admission statistics afresh
        self._requests.add(request_id, seqs, self.weight_version)

    def has_unfinished_requests(self) -> bool:
        """Whether a sequence is still to be generated, or a sampled token still to reach the host: `step()` has
        work. A request whose samples are all done waits in `pop_finished`."""
        return not self.scheduler.is_finished() or self._inflight is not None

    def pop_finished(self) -> list[tuple[Any, RolloutOutput]]:
        """(request_id, output) of each request whose samples have all finished since the last call, in the order
        they finished; each request once. The output is `generate`'s for that request alone, plus `versions`
        and the request's own `rollout/num_preemptions` and `rollout/num_interrupted` (how many of its sequences
        interrupts preempted, counting each interrupt). With overlapped scheduling a sample's last token reaches
        the host one step late: its request comes at the next call after the next `step()`, or at once when the
        engine has nothing left to run (the step on the device is resolved then)."""
        if self._inflight is not None and self.scheduler.is_finished():
            self._resolve(self._inflight)
            self._inflight = None
        return self._requests.pop_ready()

    def interrupt(self) -> int:
        """Partial rollout: resolve the step still on the device, then preempt every unfinished sequence that holds
        KV blocks (running or mid-prefill) by recompute; they keep their tokens and log-probs and continue, in
        order, at the next `step()`. Returns how many were interrupted (0 when idle)."""
        self._resolve(self._inflight)
        self._inflight = None
        seqs = self.scheduler.preempt_all()
        for seq in seqs:
            self._requests.interrupted(seq)
        return len(seqs)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int,
                     local: bool = False) -> None:
        """Copy new weights in place (HF names) while requests are unfinished, provided no sequence holds KV
        computed by the old ones (after `interrupt()`, or when idle); drop every cached prefix and the waiting
        image prompts' embeddings (their next prefill encodes them with the new vision tower); the unfinished
        sequences sample their next tokens with weights `version` (recorded in their `versions`). A sync may load
        its tensors in several calls (buckets) with the same `version`. `local`: a tensor-parallel rank's tensors
        are its slices already (a resharding sync), copied as they are."""
        sch = self.scheduler
        holding = len(sch.running) + (sch.prefilling is not None)
        if holding:
            raise RuntimeError(f"LatheEngine.load_weights: {holding} sequences hold KV computed with weight version "
                               f"{self.weight_version}; call engine.interrupt() first (partial rollout), or load "
                               "once no request is unfinished")
        self._resolve(self._inflight)       # tokens sampled by the old weights (all finished: nothing holds KV)
        self._inflight = None
        self._copy_weights(named_tensors, local=local)
        if self.block_manager.holds_cache:          # (a sync loading bucket by bucket resets once)
            self.block_manager.reset()              # (image prompts' blocks too: the images' salt is in their key)
        # image prompts encode again with the new tower at their next prefill: the waiting ones (a follower's came
        # from its leader) and any other this engine prepared that is still held (an agent's trajectory between turns)
        drop_embeddings([*(seq.mm for seq in sch.waiting if seq.mm is not None), *self.prepared_images])
        if version != self.weight_version:
            self._requests.new_version(version)
            self.weight_version = version
