"""A `Rollout` over transformers' `generate`: the reference backend, works for any causal LM.

Log-probs are `log_softmax(logits / T)` of the sampled token, over the full vocabulary: the same
quantity the trainer computes, not the top-k/top-p truncated distribution sampling drew from.
They are gathered step by step as `generate` runs (`SampledLogProbs`), never from all steps' logits at
once: at a 152k vocabulary, (sequences x new tokens x vocabulary) floats would be hundreds of GB.

Stop strings (`SamplingParams.stop`, needs `tokenizer`) follow `lathe.generation.stop`'s rule, so both backends
cut at the same token: a stopping criterion running that rule ends rows early, then each row is cut after it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from lathe.generation import RolloutOutput, SamplingParams
from lathe.generation.stop import StopStrings, first_stop
from lathe.models.io import copy_named_tensors


class HFRollout:
    """Generates with `model.generate`, `max_num_seqs` sequences at a time.

    The model may be the actor's own module (colocated, one process): weights are then already in
    sync and `update_weights` only copies tensors that are not the same storage.
    """

    def __init__(self, model, *, eos_token_id: int | list[int], pad_token_id: int, max_num_seqs: int = 1024,
                 tokenizer=None):
        from transformers import GenerationConfig
        self.model = model
        self.eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.pad_id = pad_token_id
        self.max_num_seqs = max_num_seqs
        self.tokenizer = tokenizer     # only needed for stop strings
        # A checkpoint's generation_config.json (repetition penalty, top_k=20 ...) must not leak into RL sampling:
        # transformers fills unset sampling options from the model's config, so it is replaced at every call.
        self.clean_config = GenerationConfig(eos_token_id=self.eos_ids, pad_token_id=pad_token_id)

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, *, first_index: int = 0
                 ) -> RolloutOutput:
        """transformers' sampling draws from one generator for the whole call: with `first_index` (a rank's share
        of a data-parallel rollout) the seed is mixed with it, so shares differ, but the samples are not those of
        one undivided call (lathe's engine seeds each sample instead)."""
        if params.stop and self.tokenizer is None:
            raise ValueError(f"SamplingParams.stop={params.stop!r}: stop strings need a tokenizer; build the "
                             "rollout with HFRollout(..., tokenizer=tokenizer)")
        prompts = [p for p in prompt_token_ids for _ in range(params.n)]
        out = RolloutOutput([], [], [])
        was_training = self.model.training
        self.model.eval()
        self.model.generation_config = self.clean_config
        try:
            with torch.random.fork_rng(devices=[], enabled=params.seed is not None):
                if params.seed is not None:
                    torch.manual_seed(params.seed if not first_index else
                                      int.from_bytes(hashlib.sha256(f"{params.seed}/{first_index}".encode()).digest()[:8],
                                                     "little") >> 1)
                for i in range(0, len(prompts), self.max_num_seqs):
                    self._generate_chunk(prompts[i:i + self.max_num_seqs], params, out)
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams, out: RolloutOutput) -> None:
        from transformers import StoppingCriteriaList
        device = next(self.model.parameters()).device
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p)
            mask[i, P - len(p):] = 1
        stop_ids = [] if params.ignore_eos else self.eos_ids + list(params.stop_token_ids)
        criteria = StoppingCriteriaList()
        if params.stop:
            criteria.append(_stop_string_criterion(params, self.tokenizer, len(prompts), P))
        log_probs = _sampled_log_probs(self.model, params.logprob_temperature)   # hooks the model: remove()
        criteria.append(log_probs)
        try:
            sequences = self.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device),
                do_sample=not params.greedy, temperature=None if params.greedy else params.temperature,
                top_p=None if params.greedy else params.top_p,
                top_k=None if params.greedy or params.top_k <= 0 else params.top_k,
                max_new_tokens=params.max_tokens, min_new_tokens=params.min_tokens or None,
                eos_token_id=stop_ids or None, pad_token_id=self.pad_id,
                stopping_criteria=criteria, return_dict_in_generate=False, use_cache=True,
            )
        finally:
            log_probs.remove()
        new = sequences[:, P:].cpu()
        if new.shape[1] == 0:
            out.token_ids.extend([] for _ in prompts)
            out.logprobs.extend([] for _ in prompts)
            out.finish_reasons.extend("length" for _ in prompts)
            return
        self._append_rows(out, new, log_probs.result(new.shape[1]), params, stop_ids)

    def _append_rows(self, out: RolloutOutput, new: torch.Tensor, token_logp: torch.Tensor, params: SamplingParams,
                     stop_ids: list[int]) -> None:
        """Cut each row of (B, new) tokens and log-probs after its first stop id or stop string (rows that
        finished early were padded by `generate`) and append it to `out`."""
        stops = StopStrings.from_tokenizer(params.stop, self.tokenizer) if params.stop else None
        stop = torch.zeros_like(new, dtype=torch.bool)
        for s in stop_ids:
            stop |= new == s
        for row in range(new.shape[0]):
            hits = stop[row].nonzero()
            end = int(hits[0]) + 1 if len(hits) else min(new.shape[1], params.max_tokens)
            cut = None
            if stops is not None:
                cut = first_stop(new[row, :end].tolist(), stops, min_tokens=params.min_tokens)
            end = end if cut is None else cut
            out.token_ids.append(new[row, :end].tolist())
            out.logprobs.append(token_logp[row, :end].tolist())
            out.finish_reasons.append("stop" if len(hits) or cut is not None else "length")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        copy_named_tensors(self.model, named_tensors, who="rollout model")


def _sampled_log_probs(model, temperature: float):
    """A stopping criterion (it never stops a row) that collects `log_softmax(raw logits / temperature)` of each
    step's sampled token while `model.generate` runs; `result(n)` is the (B, n) tensor, `remove()` unhooks.

    transformers' `generate` runs the model once per step, then samples, appends the token and calls the stopping
    criteria. A forward hook keeps the last position's raw logits of the latest forward; the criterion gathers the
    log-prob of the token just appended and drops them. So at most one step's (B, V) logits are held, beside the
    ones `generate` holds itself. Raw logits, not the scores the logits processors hand on: those carry the
    top-k/top-p masks and min_tokens' banned eos, in an order that is transformers' to choose. Finished rows get
    the pad token and a log-prob that the caller cuts off with the row.
    """
    from transformers import StoppingCriteria

    class SampledLogProbs(StoppingCriteria):
        # no `eos_token_id` attribute: `generate` would take this for an eos criterion
        def __init__(self):
            self.steps: list[torch.Tensor] = []
            self.logits: torch.Tensor | None = None
            self.hook = model.register_forward_hook(self.keep_logits)

        def keep_logits(self, module, args, output) -> None:
            self.logits = output.logits[:, -1]                       # (B, V) view, raw, the model's dtype

        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            if self.logits is None:
                raise RuntimeError("generate appended a token without running the model: this generation mode "
                                   "is not supported by HFRollout's log-prob capture")
            logp = torch.log_softmax(self.logits.float() / temperature, dim=-1)
            self.steps.append(logp.gather(-1, input_ids[:, -1:]).squeeze(-1))
            self.logits = None
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        def result(self, n: int) -> torch.Tensor:
            if len(self.steps) < n:
                raise RuntimeError(f"captured {len(self.steps)} log-prob steps for {n} generated tokens")
            return torch.stack(self.steps[:n], dim=1).float().cpu()

        def remove(self) -> None:
            self.hook.remove()
            self.logits = None

    return SampledLogProbs()


def _stop_string_criterion(params: SamplingParams, tokenizer, batch_size: int, prompt_width: int):
    """A transformers stopping criterion that ends a row when `lathe.generation.stop`'s rule fires on it.

    (transformers' own `stop_strings` matches token strings, not decoded text, and ignores `min_tokens`.)
    """
    from transformers import StoppingCriteria

    class StopStringCriterion(StoppingCriteria):
        def __init__(self):
            stops = StopStrings.from_tokenizer(params.stop, tokenizer)
            self.matchers = [stops.matcher(min_tokens=params.min_tokens, prompt_len=prompt_width)
                             for _ in range(batch_size)]

        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            done = [m.check(row) for m, row in zip(self.matchers, input_ids.tolist())]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StopStringCriterion()
