"""Which tokens of a micro-batch's forward enter the routers' statistics (the load-balancing losses and the z-loss of
`lathe.models.moe.RouterStats`): the real tokens of its real rows, wherever the forward puts them.

A sparse layer routes every row of the stream it is given, and that stream holds more than the real tokens:
- a padded forward (`use_remove_padding=false`) routes all B x L positions, padding included;
- a sequence-parallel rank routes its slice of the packed stream, whose last slice ends in padding
  (`lathe.train.ulysses`);
- a rank's share of an update may hold ghost rows (`lathe.batch.GHOST`: copies of the shortest row that pad a
  mini-batch that does not divide over the data-parallel ranks, `lathe.cluster.dispatch`), whose tokens are real
  tokens of a sequence that is not there.
Left in, these would change each expert's share of the tokens and its mean probability: a run whose mini-batch
needs ghost rows would balance its experts over other tokens than the same run on a count of ranks that divides it,
and a padded forward other tokens than a packed one. `router_tokens` gives, for each layout the forward may take, the
indices of the tokens that count, so that the statistics, the losses and their gradients are those of the real
tokens alone (transformers' `load_balancing_loss_func` leaves padding out the same way, by its attention mask).

The indices are worked out on the host, from the micro-batch's host mask (`lathe.train.micro.HOST_MASK`), and moved
without waiting for the device. A micro-batch with no padding and no ghost rows needs none (None).
"""

from __future__ import annotations

import torch

from lathe.batch import GHOST, Batch
from lathe.device import to_device
from lathe.train.micro import HOST_MASK
from lathe.train.ulysses import SequenceParallel, padded_length


def router_tokens(batch: Batch, sp: SequenceParallel | None = None) -> dict[int, torch.Tensor] | None:
    """{length of a routed stream: the (n,) indices of its tokens that count} for the forwards `batch` may get: the
    packed stream of its real tokens (row by row) and the padded B x L grid; with `sp`, this rank's slice of the
    packed stream instead. None where every routed token counts (a packed forward of a micro-batch without ghost
    rows)."""
    host = batch.tensors.get(HOST_MASK)
    real = (host if host is not None and host.shape == batch["attention_mask"].shape
            else batch["attention_mask"].cpu()).bool()
    counted = real.clone()
    if GHOST in batch:
        counted &= ~batch[GHOST].cpu().bool().unsqueeze(-1)
    packed = counted[real]                    # the packed stream's tokens, in its order
    device = batch["input_ids"].device
    if sp is not None:
        per = padded_length(len(packed), sp.size) // sp.size
        mine = torch.zeros(per * sp.size, dtype=torch.bool)
        mine[:len(packed)] = packed
        return {per: _moved(mine[sp.rank * per:(sp.rank + 1) * per], device)}
    if bool(counted.all()):
        return None
    return {len(packed): _moved(packed, device), counted.numel(): _moved(counted.flatten(), device)}


def _moved(keep: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The indices of `keep`'s True entries, on `device` without waiting for it."""
    return to_device(torch.nonzero(keep).flatten(), device)
