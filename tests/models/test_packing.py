"""Packing a padded batch into one token stream and back."""

import torch

from lathe.models.packing import pack_padded, pack_sequences, position_ids_from_mask, unpack_to_padded


def test_pack_keeps_real_tokens_in_order_and_unpack_restores_them():
    ids = torch.arange(12).view(3, 4)
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]])
    p = pack_padded(ids, mask)
    assert p.input_ids.tolist() == [2, 3, 4, 5, 6, 9, 10, 11]
    assert p.position_ids.tolist() == [0, 1, 0, 1, 2, 0, 1, 2]
    assert p.cu_seqlens.tolist() == [0, 2, 5, 8] and p.cu_seqlens.dtype == torch.int32
    assert p.max_seqlen == 3
    back = unpack_to_padded(p.input_ids, p, fill=-1)
    assert torch.equal(back, torch.where(mask.bool(), ids, -1))


def test_given_position_ids_are_kept():
    ids = torch.zeros(1, 3, dtype=torch.long)
    mask = torch.ones(1, 3, dtype=torch.long)
    assert pack_padded(ids, mask, torch.tensor([[5, 6, 7]])).position_ids.tolist() == [5, 6, 7]


def test_unpack_is_differentiable():
    mask = torch.tensor([[1, 0], [1, 1]])
    p = pack_padded(torch.zeros_like(mask), mask)
    x = torch.ones(3, 2, requires_grad=True)
    unpack_to_padded(x, p).sum().backward()
    assert torch.equal(x.grad, torch.ones(3, 2))


def test_pack_sequences_and_position_ids_from_mask():
    ids, pos, cu, mx = pack_sequences([torch.tensor([1, 2, 3]), torch.tensor([4])])
    assert ids.tolist() == [1, 2, 3, 4] and pos.tolist() == [0, 1, 2, 0] and cu.tolist() == [0, 3, 4] and mx == 3
    assert position_ids_from_mask(torch.tensor([[0, 1, 1, 0]])).tolist() == [[0, 0, 1, 1]]
