"""Speculative decoding in `LatheEngine` (`num_speculative_tokens=k`): MTP drafts, one verify forward, exact acceptance.

A speculative engine's steps are still a prefill or a decode (`scheduler.py`), and run eagerly (no CUDA graphs, no
overlap of the host with the device: each step's tokens are on the host when it returns):

- prefill (a chunk of prompts, as always): besides the next-token logits of the sequences whose prompt completes, the
  MTP layer's cache entries of the chunk's tokens are written (`mtp_draft.py`); the hidden state of each complete
  prompt's last position is kept (`Sequence.spec_hidden`) until its sampled token is known.
- decode = verify: for each running sequence with committed tokens x_0..x_{L-1} (x_{L-1} without KV yet):
  1. the MTP layer runs over the positions whose entries wait for their token (the last step's accepted tokens) and
     drafts d_1, then d_2..d_k one position at a time (k = `Sequence.lookahead`: fewer near the length limit);
  2. one forward of the main model over x_{L-1}, d_1..d_k as a (k+1)-token chunk over the cached prefix, through the
     chunked-prefill path (`ModelRunner.prefill_hidden`), writes their KV and gives the k+1 next-token distributions;
  3. `speculative.accept_drafts` accepts n leading drafts and emits one more token, each distributed exactly as the
     target's (`speculative.py`); the tokens are committed one by one with the stop rules of the non-speculative path
     (a stop id or string, or the length limit, ends the sequence there and drops the tokens after it);
  4. the KV of the rejected drafts is dropped by moving the sequence's cached length back: its slots are written
     again by later steps. The blocks reserved for the drafts stay with the sequence (its next steps use them).

Composes with preemption by recompute (a readmitted sequence's prefill rewrites its MTP entries too), prefix caching
(full blocks only: `BlockManager(share_partial=False)`; a prefix hit recomputes the last cached position's hidden
state, `BlockManager.hit_overlap`, and a block is keyed only once its main and MTP entries are final),
`max_tokens`/stop ids/stop strings, weight syncs (the MTP layers' tensors are the model's: `update_weights` copies
them when the trainer sends them), streamed requests and their interruption (partial rollout, the agent loop).
"""

from __future__ import annotations

import numpy as np
import torch

from lathe.device import to_device
from lathe.engine.mtp_draft import MtpDrafter
from lathe.engine.sampler import sample_on_device
from lathe.engine.sequence import Sequence
from lathe.engine.speculative import accept_drafts, target_probs, verify_uniforms
from lathe.models.mtp import has_mtp

KEY = "actor_rollout_ref.model.mtp"


def refuse_speculative(engine, k: int, *, vl: bool, hybrid: bool, mla: bool, quantization: str | None,
                       record_routing: bool, kv_cache_dtype: str | None = None) -> None:
    """Raise for what speculative decoding does not combine with in lathe's engine, naming the setting."""
    if k < 0:
        raise ValueError(f"num_speculative_tokens={k}: must be >= 0 (0: no speculative decoding)")
    model = engine.model
    if not has_mtp(model):
        raise ValueError(f"{KEY}.enable_rollout=true (speculative decoding, {k} draft tokens): the policy "
                         f"({type(model).__name__}) has no multi-token-prediction layers to draft with (lathe drafts "
                         "with MiMo's model.mtp_layers: MiMoForCausalLM with num_nextn_predict_layers >= 1 and the "
                         f"layers' tensors in the checkpoint). Fix: set {KEY}.enable_rollout=false, or use a "
                         "checkpoint with MTP layers.")
    unsupported = [(vl, "a vision-language model"), (hybrid, "linear-attention layers"), (mla, "latent attention"),
                   (quantization is not None, f"actor_rollout_ref.rollout.quantization={quantization}"),
                   (kv_cache_dtype not in (None, "auto"), f"actor_rollout_ref.rollout.kv_cache_dtype={kv_cache_dtype}"),
                   (record_routing, "actor_rollout_ref.rollout.enable_rollout_routing_replay=true")]
    for bad, what in unsupported:
        if bad:
            raise ValueError(f"{KEY}.enable_rollout=true with {what}: speculative decoding beside it is not "
                             f"implemented yet in lathe's engine. Fix: set {KEY}.enable_rollout=false.")


class SpeculativeMixin:
    """`LatheEngine`'s speculative steps (module doc)."""

    def _init_speculative(self, k: int) -> None:
        self.num_speculative_tokens = k
        self.drafter = None
        if k == 0:
            return
        self.async_scheduling = False
        self.block_manager.share_partial = False
        self.block_manager.hit_overlap = 1
        self.scheduler.num_lookahead_slots = k
        self.drafter = MtpDrafter(self.model, self.kv_cache.num_blocks, self.kv_cache.block_size)

    @torch.inference_mode()
    def _speculative_step(self) -> int:
        seqs, is_prefill, copies = self.scheduler.schedule()
        self.kv_cache.copy_blocks(copies)
        self.drafter.cache.copy_blocks(copies)
        if is_prefill:
            self._spec_prefill(seqs)
        elif seqs:
            self._spec_verify(seqs)
        return len(seqs)

    # ---- prefill -------------------------------------------------------------------------------------
    def _spec_prefill(self, seqs: list[Sequence]) -> None:
        """A prefill step: the chunk's hidden states, the MTP entries of its tokens whose next token is known, then
        the complete prompts' first tokens sampled (as the non-speculative step samples them)."""
        num_new = [s.num_scheduled_tokens for s in seqs]
        starts = [s.num_cached_tokens for s in seqs]
        hidden = self.runner.prefill_hidden(seqs, num_new)
        offsets = np.concatenate([[0], np.cumsum(num_new)])
        known = [min(n, len(s) - 1 - a) for s, n, a in zip(seqs, num_new, starts)]    # positions with a next token
        self._mtp_extend([s for s, m in zip(seqs, known) if m > 0], [a for a, m in zip(starts, known) if m > 0],
                         hidden, [offsets[i] + np.arange(m) for i, m in enumerate(known) if m > 0])
        complete = self.scheduler.prefill_done(seqs)
        if not complete:
            return
        done = {id(s) for s in complete}
        last = [int(offsets[i + 1]) - 1 for i, s in enumerate(seqs) if id(s) in done]
        rows = hidden[to_device(torch.tensor(last), hidden.device)]
        for seq, row in zip(complete, rows):
            seq.spec_hidden = row[None]
            seq.spec_keyed = len(seq) // self.block_manager.block_size     # its full blocks (keyed at allocation)
        tokens, logprobs = sample_on_device(self.model.lm_head(rows), complete).tolist()
        for seq, tok, lp in zip(complete, tokens, logprobs):
            self._commit(seq, [int(tok)], [lp])

    def _mtp_extend(self, seqs: list[Sequence], starts: list[int], hidden: torch.Tensor, rows: list[np.ndarray]
                    ) -> torch.Tensor | None:
        """MTP entries of sequence i's positions starts[i].. (their hidden states `hidden[rows[i]]`, their next
        tokens committed); returns the layer's output at each sequence's last such position."""
        if not seqs:
            return None
        index = to_device(torch.from_numpy(np.concatenate(rows).astype(np.int64)), hidden.device)
        tokens = [s.token_ids[a + 1:a + 1 + len(r)] for s, a, r in zip(seqs, starts, rows)]
        out = self.drafter.run(seqs, starts, hidden.index_select(0, index), tokens)
        ends = np.cumsum([len(r) for r in rows]) - 1
        return out[to_device(torch.from_numpy(ends), out.device)]

    # ---- verify --------------------------------------------------------------------------------------
    def _draft(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Each sequence's drafts (step 1 of the module doc): its pending MTP entries, then `ks[i]` draft tokens."""
        pending = [s.spec_hidden for s in seqs]
        counts = [len(p) for p in pending]
        starts = [len(s) - 1 - m for s, m in zip(seqs, counts)]
        offsets = np.concatenate([[0], np.cumsum(counts)])
        out = self._mtp_extend(seqs, starts, torch.cat(pending), [np.arange(offsets[i], offsets[i + 1])
                                                                   for i in range(len(seqs))])
        for s in seqs:
            s.spec_hidden = None
        drafts: list[list[int]] = [[] for _ in seqs]
        rows = list(range(len(seqs)))           # the sequence of each row of `out`
        for step in range(max(ks, default=0)):
            keep = [j for j, i in enumerate(rows) if ks[i] > step]
            if len(keep) < len(rows):
                out = out.index_select(0, to_device(torch.tensor(keep), out.device))
                rows = [rows[j] for j in keep]
            if step:                # one position on, on the last draft and the layer's own last output
                out = self.drafter.run([seqs[i] for i in rows], [len(seqs[i]) - 2 + step for i in rows], out,
                                       [[drafts[i][-1]] for i in rows])
            for i, t in zip(rows, self.drafter.greedy(out).tolist()):
                drafts[i].append(int(t))
        return drafts

    def _spec_verify(self, seqs: list[Sequence]) -> None:
        """A decode step of the speculative engine (module doc)."""
        ks = [s.lookahead(self.num_speculative_tokens) for s in seqs]
        drafts = self._draft(seqs, ks)
        committed = [len(s) for s in seqs]
        for s, d, n in zip(seqs, drafts, committed):
            s.token_ids.extend(d)
            s.num_cached_tokens = s.num_kv_cached = n - 1
        try:
            hidden = self.runner.prefill_hidden(seqs, [k + 1 for k in ks])
        finally:
            for s, n in zip(seqs, committed):
                del s.token_ids[n:]
        logits = self.model.lm_head(hidden).float()
        tokens, logprobs, accepted = self._accept(seqs, ks, drafts, logits)
        offsets = np.concatenate([[0], np.cumsum([k + 1 for k in ks])])
        for i, seq in enumerate(seqs):
            n = accepted[i]
            seq.spec_drafts += ks[i]
            seq.spec_accepted += n
            seq.spec_verifies += 1
            self._commit(seq, tokens[i], logprobs[i])
            if seq.is_finished:
                continue
            seq.num_cached_tokens = seq.num_kv_cached = len(seq) - 1
            seq.spec_hidden = hidden[int(offsets[i]):int(offsets[i]) + n + 1]
            self._key_blocks(seq, committed[i])

    def _accept(self, seqs: list[Sequence], ks: list[int], drafts: list[list[int]], logits: torch.Tensor):
        """(tokens, log-probs, accepted drafts) per sequence from the verify logits (T, V) (`accept_drafts`)."""
        k = max(ks)
        rows, params, banned, index = 0, [], [], []
        for s, kk in zip(seqs, ks):
            for j in range(kk + 1):
                params.append(s.params)
                if s.num_output_tokens + j < s.params.min_tokens:
                    banned.extend((rows + j, t) for t in s.params.stop_token_ids)
            index.extend(rows + min(j, kk) for j in range(k + 1))
            rows += kk + 1
        probs = target_probs(logits, params, banned)
        device = logits.device
        padded = probs[to_device(torch.tensor(index), device)].view(len(seqs), k + 1, -1)
        draft_ids = torch.tensor([d + [-1] * (k - len(d)) for d in drafts], dtype=torch.int64).view(len(seqs), k)
        n, token = accept_drafts(padded, to_device(draft_ids, device), to_device(torch.tensor(ks), device),
                                 to_device(torch.from_numpy(verify_uniforms(seqs, k)), device))
        n, token = n.tolist(), token.tolist()
        temps = to_device(torch.tensor([p.logprob_temperature for p in params]), device)[:, None]
        chosen, start = [], 0
        for i, kk in enumerate(ks):
            chosen.extend(drafts[i][:n[i]] + [token[i]])
            chosen.extend([0] * (kk - n[i]))                  # rows past the emitted token: not read
            start += kk + 1
        lp = torch.log_softmax(logits / temps, -1).gather(1, to_device(torch.tensor(chosen), device)[:, None])[:, 0]
        lp = lp.double().tolist()
        out_tokens, out_lps, start = [], [], 0
        for i, kk in enumerate(ks):
            out_tokens.append(chosen[start:start + n[i] + 1])
            out_lps.append(lp[start:start + n[i] + 1])
            start += kk + 1
        return out_tokens, out_lps, n

    # ---- commit --------------------------------------------------------------------------------------
    def _commit(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> None:
        """Append `tokens` to `seq` in order, ending it at the first stop id or stop string (reason "stop") or at its
        length limit ("length"; "stop" when that token is also a stop), as the non-speculative step's placeholders
        and `_resolve` do; the tokens after that are dropped."""
        matcher = self._stop_matchers.get(seq)
        for tok, lp in zip(tokens, logprobs):
            seq.token_ids.append(tok)
            seq.logprobs.append(lp)
            if tok in seq.params.stop_token_ids or (matcher is not None and matcher.check(seq.token_ids)):
                self.scheduler.finish(seq, "stop")
                return
            if len(seq.token_ids) >= seq.length_limit:
                self.scheduler.finish(seq, "length")
                return

    def _key_blocks(self, seq: Sequence, valid: int) -> None:
        """Key `seq`'s full blocks whose first `valid` slots hold final main and MTP entries (prefix caching)."""
        bm = self.block_manager
        while (seq.spec_keyed + 1) * bm.block_size <= valid:
            bm.register_full(seq, seq.spec_keyed)
            seq.spec_keyed += 1
