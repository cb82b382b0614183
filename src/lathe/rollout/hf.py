"""A `Rollout` over transformers' `generate`: the reference backend, works for any causal LM.

Log-probs are `log_softmax(logits / T)` of the sampled token, over the full vocabulary: the same
quantity the trainer computes, not the top-k/top-p truncated distribution sampling drew from.

Stop strings (`SamplingParams.stop`, needs `tokenizer`) follow `lathe.engine.stop`'s rule, so both backends
cut at the same token: a stopping criterion running that rule ends rows early, then each row is cut after it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lathe.engine.stop import StopStrings, first_stop
from lathe.rollout.base import RolloutOutput, SamplingParams, copy_named_tensors


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
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
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
                    torch.manual_seed(params.seed)
                for i in range(0, len(prompts), self.max_num_seqs):
                    self._generate_chunk(prompts[i:i + self.max_num_seqs], params, out)
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams, out: RolloutOutput) -> None:
        device = next(self.model.parameters()).device
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p)
            mask[i, P - len(p):] = 1
        stop_ids = [] if params.ignore_eos else self.eos_ids + list(params.stop_token_ids)
        early = {}
        if params.stop:
            early["stopping_criteria"] = _stop_string_criteria(params, self.tokenizer, len(prompts), P)
        gen = self.model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device),
            do_sample=not params.greedy, temperature=None if params.greedy else params.temperature,
            top_p=None if params.greedy else params.top_p,
            top_k=None if params.greedy or params.top_k <= 0 else params.top_k,
            max_new_tokens=params.max_tokens, min_new_tokens=params.min_tokens or None,
            eos_token_id=stop_ids or None, pad_token_id=self.pad_id,
            output_logits=True, return_dict_in_generate=True, use_cache=True, **early,
        )
        new = gen.sequences[:, P:].cpu()
        if new.shape[1] == 0:
            out.token_ids.extend([] for _ in prompts)
            out.logprobs.extend([] for _ in prompts)
            out.finish_reasons.extend("length" for _ in prompts)
            return
        logits = torch.stack(gen.logits, dim=1).float().cpu()          # (B, new, V), raw
        logp = torch.log_softmax(logits / params.logprob_temperature, dim=-1)
        token_logp = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)
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


def _stop_string_criteria(params: SamplingParams, tokenizer, batch_size: int, prompt_width: int):
    """A transformers stopping criterion that ends a row when `lathe.engine.stop`'s rule fires on it.

    (transformers' own `stop_strings` matches token strings, not decoded text, and ignores `min_tokens`.)
    """
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopStringCriterion(StoppingCriteria):
        def __init__(self):
            stops = StopStrings.from_tokenizer(params.stop, tokenizer)
            self.matchers = [stops.matcher(min_tokens=params.min_tokens, prompt_len=prompt_width)
                             for _ in range(batch_size)]

        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            done = [m.check(row) for m, row in zip(self.matchers, input_ids.tolist())]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([StopStringCriterion()])
