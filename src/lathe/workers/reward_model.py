"""The reward-model worker (verl's `RewardModelWorker`): a discriminative reward model that scores each response.

Built from `reward_model.*`: a sequence-classification checkpoint (`reward_model.model.path`, one label) and its
tokenizer, in eval mode, bf16 on an accelerator and fp32 on the CPU. A row's score is the model's logit at the last
real token of its input:

* when the reward model's tokenizer is the policy's (same vocabulary and chat template), the input is the row's
  own tokens, prompt and response, as the policy saw them;
* otherwise (verl's `_switch_chat_template`) the row is rendered again as text: the prompt's chat messages
  (`raw_prompt`) followed by `{"role": "assistant", "content": response}`, the response decoded with the policy's
  tokenizer and its end-of-sequence text removed, rendered with the reward model's chat template (no generation
  prompt) and tokenized with the reward model's tokenizer.

Inputs longer than `reward_model.max_length` (default: `data.max_prompt_length + max_response_length`; verl's is
the batch's padded width, which depends on the other rows) keep their first `max_length` tokens (verl's default
right truncation). Rows are scored in micro-batches of `micro_batch_size_per_gpu` rows, or of at most
`forward_max_token_len_per_gpu` tokens with `use_dynamic_bsz`:

* where lathe's decoder implements the architecture (Llama, Qwen2/2.5, Qwen3, Qwen3-MoE, GPT-OSS, DeepSeek-V3; one
  label, a `score` head without bias: `lathe.models.reward`), the checkpoint's tensors move into lathe's decoder
  and each micro-batch is one packed forward, the rows laid end to end with no padding (`cu_seqlens`, as the
  actor's log-prob pass), the head applied to each row's last hidden state;
* otherwise transformers' model runs, each micro-batch padded on the right to its longest row.

Which of the two runs is logged once, at start-up. With `model.fsdp_config.param_offload` the weights stay in host
memory between calls and visit the device only while scoring. Every rank holds a whole copy (the reward model is not
sharded).
"""

from __future__ import annotations

import logging

import torch

from lathe.batch import Batch
from lathe.models.config import UnsupportedArchitecture
from lathe.models.hf import import_external_libs, load_tokenizer, resolve
from lathe.models.reward import lathe_reward_model, packed_scores
from lathe.train.micro import token_balanced_partitions

log = logging.getLogger("lathe")
RM = "reward_model"
IMPLS = ("auto", "lathe", "hf")


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers give the same ids and render chats alike (then no re-rendering is needed)."""
    return a is b or (a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) ==
                      getattr(b, "chat_template", None))


def load_reward_model(path: str, *, dtype: torch.dtype, trust_remote_code: bool = False):
    """The sequence-classification model of `path` (one label), in eval mode, with no gradients."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(
        resolve(path), num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code)
    model.eval().requires_grad_(False)
    return model


def micro_batch_size(cfg, plan) -> int:
    """Rows per reward-model forward: `reward_model.micro_batch_size_per_gpu`, else the policy's log-prob
    micro-batch (filled in from `actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu`), else the actor's."""
    return cfg.reward_model.micro_batch_size_per_gpu or plan.actor.micro_batch_per_device


def select_reward_impl(model, impl: str = "auto"):
    """(the module that scores, whether it is lathe's decoder (packed), what runs in words) for a loaded transformers
    reward model: lathe's decoder where it implements the architecture (`impl="auto"`; `"lathe"`: that or an
    error), else `model` itself (`"hf"`: always)."""
    if impl not in IMPLS:
        raise ValueError(f"reward model impl={impl!r} is unknown; use one of {', '.join(IMPLS)}")
    name = type(model).__name__
    if impl == "hf":
        return model, False, f"transformers {name} (impl=hf), padded micro-batches"
    try:
        lathe = lathe_reward_model(model)
    except UnsupportedArchitecture as e:
        if impl == "lathe":
            raise
        return model, False, f"transformers {name}, padded micro-batches ({e})"
    return lathe, True, f"lathe decoder ({name}, {lathe.config.num_hidden_layers} layers), packed micro-batches"


def rm_micro_batches(lengths: list[int], reward_model_cfg, micro_batch_size: int) -> list[list[int]]:
    """Row indices of each forward: by token budget (`reward_model.forward_max_token_len_per_gpu`) with
    `reward_model.use_dynamic_bsz`, else runs of `micro_batch_size` rows."""
    if reward_model_cfg.use_dynamic_bsz:
        return token_balanced_partitions(lengths, reward_model_cfg.forward_max_token_len_per_gpu,
                                         key=f"{RM}.forward_max_token_len_per_gpu")
    size = micro_batch_size
    return [list(range(s, min(s + size, len(lengths)))) for s in range(0, len(lengths), size)]


class RewardModelWorker:
    def __init__(self, cfg, policy_tokenizer, *, device: torch.device, micro_batch_size: int, impl: str = "auto"):
        """`cfg`: the whole config (`reward_model.*` is read); `policy_tokenizer`: the tokenizer of the responses;
        `micro_batch_size`: rows per forward without `use_dynamic_bsz` (`reward_model.micro_batch_size_per_gpu`,
        else the actor's micro-batch: `micro_batch_size`); `impl`: `select_reward_impl`'s (tests set "hf" to run
        transformers' forward whatever the architecture; no config key chooses: both give the same scores)."""
        rm = cfg.reward_model
        self.cfg, self.device, self.policy_tokenizer = rm, torch.device(device), policy_tokenizer
        self.micro_batch_size = micro_batch_size
        self.max_length = rm.max_length or cfg.data.max_prompt_length + cfg.data.max_response_length
        self.offload = rm.model.fsdp_config.param_offload
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        import_external_libs({f"{RM}.model.external_lib": rm.model.external_lib})
        self.tokenizer = load_tokenizer(rm.model.path, trust_remote_code=rm.model.trust_remote_code)
        self.model, self.packed, self.impl = select_reward_impl(
            load_reward_model(rm.model.path, dtype=dtype, trust_remote_code=rm.model.trust_remote_code), impl)
        if not self.offload:
            self.model.to(self.device)
        self.switch_template = not same_tokenizer(self.tokenizer, policy_tokenizer)
        if self.switch_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{RM}.model.path={rm.model.path}: its tokenizer differs from the policy's and has no "
                             "chat template to render the conversations with. Fix: use a reward model whose "
                             "tokenizer has a chat template (or the policy's tokenizer)")
        self._printed = False
        log.info("reward model: %s (%s parameters) on %s: %s; %s", rm.model.path,
                 f"{sum(x.numel() for x in self.model.parameters()):,}", self.device, self.impl,
                 "rendering each chat with its own template" if self.switch_template else "reading the policy's tokens")

    # -- inputs ----------------------------------------------------------------------------------------
    def rm_inputs(self, batch: Batch) -> list[list[int]]:
        """Each row's reward-model token ids (see the module docstring), cut to `max_length`."""
        if "multi_modal_inputs" in batch and any(x is not None for x in batch["multi_modal_inputs"]):
            raise NotImplementedError(f"{RM}.enable=true with image prompts: lathe's reward model scores text only. "
                                      f"Fix: train on text prompts, or set {RM}.enable=false")
        ids = self._rendered(batch) if self.switch_template else self._as_is(batch)
        return [row[:self.max_length] for row in ids]

    def _as_is(self, batch: Batch) -> list[list[int]]:
        mask = batch["attention_mask"].bool()
        return [row[m].tolist() for row, m in zip(batch["input_ids"], mask)]

    def _rendered(self, batch: Batch) -> list[list[int]]:
        texts = self.render(batch)
        if not self._printed:                              # verl prints the first rendered input once
            log.info("reward model input (first row): %r", texts[0][:2000])
            self._printed = True
        return [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]

    def render(self, batch: Batch) -> list[str]:
        """Each row as the reward model's chat text: its prompt messages and the response as the assistant's turn."""
        src, eos = self.policy_tokenizer, self.policy_tokenizer.eos_token
        lengths = batch["attention_mask"][:, -batch["responses"].shape[1]:].sum(-1).tolist()
        out = []
        for i, (ids, n) in enumerate(zip(batch["responses"].tolist(), lengths)):
            response = src.decode(ids[:n])
            if eos:
                response = response.replace(eos, "")
            chat = list(_messages(batch, i)) + [{"role": "assistant", "content": response}]
            out.append(self.tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False))
        return out

    # -- scoring ---------------------------------------------------------------------------------------
    def micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """Row indices of each forward (`rm_micro_batches`)."""
        return rm_micro_batches(lengths, self.cfg, self.micro_batch_size)

    @torch.no_grad()
    def compute_rm_score(self, batch: Batch) -> Batch:
        """`rm_scores` (B,) float32: the reward model's score of each row's prompt and response."""
        inputs = self.rm_inputs(batch)
        if self.offload:
            self.model.to(self.device)
        try:
            scores = score_rows(self.model, self.packed, inputs, self.micro_batches([len(x) for x in inputs]),
                                self.device, self.tokenizer.pad_token_id)
        finally:
            if self.offload:
                self.model.to("cpu")
        return Batch({"rm_scores": scores})



def score_rows(model, packed: bool, rows: list[list[int]], parts: list[list[int]], device: torch.device,
               pad_id: int | None) -> torch.Tensor:
    """(len(rows),) float32: each row's score, one `forward_scores` per micro-batch of `parts` (row indices)."""
    scores = torch.zeros(len(rows), dtype=torch.float32)
    for part in parts:
        scores[part] = forward_scores(model, packed, [rows[i] for i in part], device, pad_id)
    return scores


@torch.no_grad()
def forward_scores(model, packed: bool, rows: list[list[int]], device: torch.device, pad_id: int | None
                   ) -> torch.Tensor:
    """(len(rows),) float32: the logit at the last real token of each row, from one forward of `model`
    (`select_reward_impl`'s): packed on lathe's decoder, else padded on the right with `pad_id`."""
    if packed:
        return packed_scores(model, rows, device)
    width, pad = max(len(r) for r in rows), pad_id or 0
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    last = torch.tensor([len(r) - 1 for r in rows], device=device)
    backbone = getattr(model, model.base_model_prefix, None)
    head = getattr(model, "score", None)
    if backbone is None or head is None:                   # an unusual head: one row at a time, no padding to find
        return torch.stack([model(input_ids=ids[i:i + 1, :n + 1]).logits[0, 0].float()
                            for i, n in enumerate(last.tolist())]).cpu()
    hidden = backbone(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    return head(hidden[torch.arange(len(rows), device=device), last])[:, 0].float().cpu()


def _messages(batch: Batch, i: int) -> list[dict]:
    """Row i's prompt as chat messages (`raw_prompt`, which lathe keeps for every row)."""
    raw = batch["raw_prompt"][i] if "raw_prompt" in batch else None
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if raw is None or not all(isinstance(m, dict) for m in raw):
        raise ValueError(f"{RM}: row {i} carries no chat messages (raw_prompt) to render for the reward model")
    return [dict(m) for m in raw]
