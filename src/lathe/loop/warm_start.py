"""`lathe train`'s supervised warm start (`actor_rollout_ref.model.warm_start`): a few supervised steps on the
training rows' `extra_info.answer` before RL, which the built-in demos need (a random model cannot find the answer
format, or a tool call, by RL alone within minutes). `loop/setup.py`'s `build_model` runs it (or reads it from the
cache, `loop/warm_cache.py`).

`extra_info.answer` is the reply to the prompt (a string: its tokens and eos are trained), or the turns that follow
the prompt (a list of messages, e.g. a tool call, the tool's answer and the reply, as `builtin:secret_lookup` has):
the prompt and these are rendered turn by turn as `lathe sft` renders a conversation, and the assistant turns
trained.
"""

from __future__ import annotations

import logging

import torch

from lathe.data import RLDataset
from lathe.data.sft import continuation_tokens, is_turns
from lathe.track import Progress
from lathe.track.progress import duration
from lathe.train.sft import supervised_fit

log = logging.getLogger("lathe")


def warm_start(cfg, model, examples: list[tuple[list[int], ...]], pad_id: int, device: torch.device) -> list[float]:
    """`warm_start.steps` supervised steps on `examples` (`warm_start_examples`), with their progress shown; returns
    the losses."""
    ws = cfg.actor_rollout_ref.model.warm_start
    log.info("warm start: %d supervised steps on extra_info.answer (actor_rollout_ref.model.warm_start.steps=0 "
             "skips it)", ws.steps)
    with Progress("warm start", ws.steps) as bar:
        losses = supervised_fit(model, examples, steps=ws.steps, lr=ws.lr, batch_size=ws.batch_size, pad_id=pad_id,
                                seed=cfg.trainer.seed, device=device,
                                on_step=lambda i, loss: bar.update(i, f"loss {loss:.3f}"))
    log.info("warm start: %d steps in %s, loss %.3f -> %.3f", len(losses), duration(bar.elapsed), losses[0],
             losses[-1])
    return losses


def warm_start_examples(cfg, tokenizer, train: RLDataset) -> list[tuple[list[int], ...]]:
    """For every training row, from `extra_info.answer`: (prompt ids, answer ids + eos) of a text answer, or (prompt
    ids, the turns' ids, their loss mask) of turns after the prompt."""
    examples, where = [], f"actor_rollout_ref.model.warm_start: {cfg.data.train_files}"
    for i in range(len(train)):
        row = train[i]
        answer = (row["extra_info"] or {}).get("answer")
        if answer is None:
            raise ValueError(f"actor_rollout_ref.model.warm_start.steps={cfg.actor_rollout_ref.model.warm_start.steps} "
                             f"needs extra_info.answer in every training row; row {row['index']} of "
                             f"{cfg.data.train_files} has none. Set warm_start.steps=0 or add the answers.")
        if is_turns(answer):                       # the turns after the prompt: a conversation
            ids, mask = continuation_tokens(tokenizer, row["raw_prompt"], answer, f"{where} row {row['index']}",
                                            "extra_info.answer", train.apply_chat_template_kwargs)
            first = mask.index(1)
            examples.append((ids[:first], ids[first:], mask[first:]))
        else:
            ids = tokenizer(str(answer), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            examples.append((row["prompt_ids"], ids))
    return examples
