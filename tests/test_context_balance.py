"""Context parallelism's balance: which sequence blocks each rank holds (optimus2d/context/balance.py).

Issue 27's targets: max / mean unmasked (query, key) pairs per rank ≤ 1.05 with head–tail on a
causal mask (c = 4), ≤ 1.10 with the makespan split on a mixed image–text mask; the uniform split
is measured beside them. Every count is recomputed here from the mask and the positions.
"""

from __future__ import annotations

import pytest
import torch

from optimus2d.context import assign, causal_mask, document_mask, image_text_mask, makespan

S = 4096
MIXED_SPANS = [(64, 640), (1500, 2076), (3000, 3576)]  # three images of 576 patches (LLaVA's 24 × 24)


def _pairs(mask: torch.Tensor, positions: torch.Tensor) -> int:
    return int(mask[positions].sum())


def _check_permutation(a, s: int, c: int) -> None:
    every = torch.cat(a.positions)
    assert torch.equal(every.sort().values, torch.arange(s)), "each token on exactly one rank"
    assert {p.numel() for p in a.positions} == {s // c}, "the same count on every rank"
    assert all(bool((p[1:] > p[:-1]).all()) for p in a.positions), "positions ascend"
    assert torch.equal(a.permutation(), every)


@pytest.mark.parametrize("method", ["uniform", "head_tail", "makespan"])
@pytest.mark.parametrize("c", [2, 3, 4])
def test_an_assignment_is_a_permutation_with_the_pairs_it_claims(method, c):
    s = 2 * c * 96
    mask = image_text_mask(s, [(10, 100)])
    a = assign(mask, c, method)
    _check_permutation(a, s, c)
    assert list(a.pairs) == [_pairs(mask, p) for p in a.positions]
    assert sum(a.pairs) == int(mask.sum())


def test_head_tail_balances_a_causal_mask_exactly():
    mask, c = causal_mask(S), 4
    uniform, head_tail = assign(mask, c, "uniform"), assign(mask, c, "head_tail")
    assert head_tail.imbalance <= 1.05
    assert len(set(head_tail.pairs)) == 1  # chunk r and chunk 2c-1-r: exactly the same on every rank
    # the count split: the last shard has (2c-1)× the first's pairs, about 1.75× the mean at c = 4
    assert uniform.imbalance == pytest.approx(2 * (2 * c - 1) / (2 * c), rel=0.01)
    assert head_tail.positions[0][: S // 8].tolist() == list(range(S // 8))  # chunk 0, then chunk 7
    assert head_tail.positions[0][S // 8 :].tolist() == list(range(7 * S // 8, S))


def test_makespan_balances_a_mixed_image_text_mask():
    mask, c = image_text_mask(S, MIXED_SPANS), 4
    split = {m: assign(mask, c, m) for m in ("uniform", "head_tail", "makespan")}
    assert split["makespan"].imbalance <= 1.10
    assert split["makespan"].imbalance < split["head_tail"].imbalance < split["uniform"].imbalance


@pytest.mark.parametrize("c", [2, 4, 8])
def test_makespan_balances_packed_documents(c):
    torch.manual_seed(0)
    lengths = torch.randint(64, 1024, (12,)).tolist()
    lengths[-1] += -sum(lengths) % (64 * c)  # a multiple of c blocks
    mask = document_mask(lengths)
    a = assign(mask, c, "makespan", block=64)
    _check_permutation(a, sum(lengths), c)
    assert a.imbalance <= 1.10, a.pairs


def test_masks_are_what_they_say():
    assert torch.equal(causal_mask(3), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    m = image_text_mask(5, [(1, 3)])
    assert m[1, 2] and m[2, 1] and not m[0, 1] and not m[2, 3] and m[4, 0]
    d = document_mask([2, 3])
    assert d[1, 0] and not d[2, 1] and d[4, 2] and not d[2, 4]
    assert document_mask([2, 1], causal=False)[0, 1]


def test_makespan_gives_equal_counts_and_the_heaviest_first():
    owner = makespan([9, 1, 1, 1, 8, 2], 2)
    assert sorted(owner.count(r) for r in range(2)) == [3, 3]
    loads = [sum(w for w, o in zip([9, 1, 1, 1, 8, 2], owner, strict=True) if o == r) for r in range(2)]
    assert sorted(loads) == [11, 11]


@pytest.mark.parametrize(
    ("mask", "c", "method", "block", "match"),
    [
        (causal_mask(10), 4, "uniform", None, r"10 tokens do not divide: pad the sequence to a multiple of 4"),
        (causal_mask(12), 4, "head_tail", None, r"into 8 equal chunks for c = 4, and 12 tokens"),
        (causal_mask(64), 4, "makespan", 5, r"blocks of 5 tokens, an equal .* c = 4: pad it to a multiple of 20"),
        (causal_mask(8).float(), 2, "uniform", None, r"square boolean \[s, s\].*got torch.float32\[8, 8\]"),
        (causal_mask(8), 0, "uniform", None, r"positive int, got 0"),
        (causal_mask(8), 2, "striped", None, r"method 'striped' is not one of"),
    ],
)  # fmt: skip
def test_refusals_name_the_sizes(mask, c, method, block, match):
    with pytest.raises(ValueError, match=match):
        assign(mask, c, method, block=block)


def test_bad_masks_are_refused():
    with pytest.raises(ValueError, match=r"span \[5, 12\) is not inside a sequence of 10 tokens"):
        image_text_mask(10, [(5, 12)])
    with pytest.raises(ValueError, match=r"at least one token, got lengths \[3, 0\]"):
        document_mask([3, 0])


def test_an_assignment_made_by_hand_is_refused_unless_a_permutation_of_equal_counts():
    """``Assignment`` is exported: one holding a token twice and another never was silently wrong
    (2.02 off), one of unequal counts refused on some ranks alone."""
    from optimus2d.context import Assignment

    ok = Assignment("mine", (torch.tensor([0, 3]), torch.tensor([1, 2])), (2, 2))
    assert ok.permutation().tolist() == [0, 3, 1, 2]
    with pytest.raises(ValueError, match=r"exactly once"):
        Assignment("mine", (torch.tensor([0, 0]), torch.tensor([1, 2])), (2, 2))
    with pytest.raises(ValueError, match=r"the same number of positions, got \[3, 1\]"):
        Assignment("mine", (torch.tensor([0, 1, 2]), torch.tensor([3])), (2, 2))
