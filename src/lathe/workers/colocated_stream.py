"""The colocated engine streaming across training steps (verl V1's `trainer.v1.trainer_mode=colocate_async`).

In each step's rollout phase the driver (`lathe.loop.colocate_async`) adds requests and runs the engine in slices of
engine steps (`run`), taking the requests that finished; once a step's worth of groups has finished it pauses the
engine (`pause`): the unfinished samples are interrupted (their tokens and log-probs kept, their KV freed:
`LatheEngine.interrupt`) and the engine sleeps while the actor trains. The new weights reach it with a new version
(`load_weights`); the interrupted samples continue under them in the next rollout phase (partial rollout), each token
keeping the weight version and the log-prob it was sampled with.

Slices count engine steps, not seconds, so which requests have finished when the driver looks depends on the
requests alone, not on the machine's speed: a run samples and trains the same on a fast device and a busy one.
"""

from __future__ import annotations

import time

from lathe.batch import Batch
from lathe.generation import RolloutOutput, SamplingParams
from lathe.rollout.base import streamed_batch


class ColocatedStream:
    """Streamed requests in the colocated engine `engine` (lathe's), across training steps (see the module
    docstring). `wake`/`sleep`: the rollout's own (the KV cache lives only while generating on a GPU, timed into
    its metrics); `pad_id` pads the rows of a finished request."""

    def __init__(self, engine, pad_id: int, *, wake, sleep):
        self.engine, self.pad_id, self._wake, self._sleep = engine, pad_id, wake, sleep
        self.awake = False
        self.prompts: dict = {}             # request id -> (prompt token ids, n) until it finishes
        self.outbox: list = []              # requests that finished during a blocking `generate`
        self.busy_s = 0.0                   # seconds spent stepping, in all
        self.timings: dict[str, float] = {}  # the wake-ups' and sleeps' seconds since the last `run` answered

    def run(self, requests: list[tuple], max_steps: int) -> dict:
        """Add `(request_id, prompt token ids, SamplingParams, first_index, multi_modal_inputs)` requests, then run
        up to `max_steps` engine steps (fewer when the engine runs out of work). Returns `{"done": [(request_id,
        Batch)], "busy_s": seconds stepping in all}` with each finished request's rows (`streamed_batch`: the
        weight version of every token)."""
        self.wake()
        for request_id, prompt_ids, params, first_index, images in requests:
            self._add(request_id, prompt_ids, params, first_index, images)
        start = time.perf_counter()
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                break
            self.engine.step()
        self.busy_s += time.perf_counter() - start
        done, self.outbox = self.outbox + self.engine.pop_finished(), []
        batches = [(rid, self._rows(rid, out)) for rid, out in done]
        if batches:                         # the wake-ups and sleeps since the last answer ride with its requests
            batches[0][1].meta["rollout_metrics"].update(self.timings)
            self.timings = {}
        return {"done": batches, "busy_s": self.busy_s}

    def pause(self) -> int:
        """Interrupt every unfinished sample (its tokens and log-probs stay, its KV goes) and sleep; returns how
        many were interrupted. They continue at the next `run`, under the weights loaded meanwhile."""
        interrupted = self.engine.interrupt() if self.awake else 0
        self.sleep()
        return interrupted

    def load_weights(self, named_tensors, version: int) -> None:
        """New weights (HF names; tensors the engine shares with the actor are skipped), `version` for the tokens
        sampled from now on. Paused first: no sample holds KV computed with the old ones."""
        if self.awake:
            self.pause()
        self.engine.load_weights(named_tensors, version=version)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, first_index: int = 0,
                 multi_modal_inputs: list | None = None) -> RolloutOutput:
        """A blocking generation (validation) beside the streamed requests, which run on meanwhile (those that
        finish wait in the outbox for the next `run`); paused again at the end."""
        key = ("blocking", time.monotonic_ns())
        self.wake()
        self._add(key, prompt_ids, params, first_index, multi_modal_inputs, keep=False)
        out = None
        while out is None:
            if self.engine.has_unfinished_requests():
                self.engine.step()
            for rid, o in self.engine.pop_finished():
                if rid == key:
                    out = o
                else:
                    self.outbox.append((rid, o))
        self.pause()
        return out

    def wake(self) -> None:
        if not self.awake:
            self._wake(self.timings)
            self.awake = True

    def sleep(self) -> None:
        if self.awake:
            self._sleep(self.timings)
            self.awake = False

    def _add(self, request_id, prompt_ids, params, first_index, images, keep: bool = True) -> None:
        self.engine.add_request(request_id, prompt_ids, params, first_index=first_index, multi_modal_inputs=images)
        if keep:
            self.prompts[request_id] = (prompt_ids, params.n)

    def _rows(self, request_id, out: RolloutOutput) -> Batch:
        prompt_ids, n = self.prompts.pop(request_id)
        return streamed_batch(prompt_ids, out, self.pad_id, n, self.engine.weight_version)
