"""Embedding2D: ``nn.Embedding`` with both the vocabulary and the hidden dim split over the mesh."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from optimus2d.comm import primitives as P
from optimus2d.comm import reduce_grad, reduce_scatter, summa_abt
from optimus2d.comm.mesh import Mesh
from optimus2d.comm.sharding import Sharding
from optimus2d.comm.traced import refuse_if
from optimus2d.layers.base import ShardedModule, fill_from_serial


class Embedding2D(ShardedModule):
    """A lookup table ``[V, h]`` of which no rank holds more than ``[⌈V/q⌉, h/q]``.

    On rank (k, i, j): ``weight`` ``[⌈V/q⌉, h/q]`` = rows block i (vocabulary, split over the column
    group), columns block j (hidden, split over the row group); replicated over depth. A vocabulary
    that does not divide by q is padded at its end with zero rows that no id reaches and that
    ``serial_state_dict`` leaves out.

    forward: token ids ``[b/(d·q), ...]`` (``optimus2d.scatter_batch``) → ``[b/(d·q), ..., h/q]``.
    Sends: all-gather of the ids over the column, reduce-scatter of the looked-up partial sums
    (backward: all-gather of the gradient, all-reduce of the weight gradient over depth).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        mesh: Mesh,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(mesh)
        mesh = self.mesh  # a DeviceMesh given: its Mesh
        if embedding_dim % mesh.q:
            raise ValueError(f"Embedding2D: embedding_dim={embedding_dim} is not divisible by q={mesh.q} ({mesh})")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"Embedding2D: padding_idx={padding_idx} must be within num_embeddings={num_embeddings}"
                )
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        sharding = Sharding((("col",), ("row",)), (num_embeddings, embedding_dim))
        self.vocab_per_rank = self.declare("weight", sharding, device=device, dtype=dtype).shape[0]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The blocks of ``nn.Embedding``'s N(0, 1) init with the same RNG state (same on every rank)."""
        full = nn.Embedding(
            self.num_embeddings,
            self.embedding_dim,
            self.padding_idx,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        self.load_serial_tensor("weight", full.weight)

    @classmethod
    def from_serial(cls, embedding: nn.Embedding, mesh: Mesh) -> Embedding2D:
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"Embedding2D.from_serial expects nn.Embedding, got {type(embedding).__name__}")
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError("Embedding2D.from_serial: max_norm, scale_grad_by_freq and sparse are not supported")
        w = embedding.weight
        module = cls(w.shape[0], w.shape[1], embedding.padding_idx, mesh=mesh, device="meta")
        fill_from_serial(module, embedding)
        return module

    def input_refusal(self, args: tuple, kwargs: dict) -> BaseException | None:
        """Ids that are not int64 or int32 (as torch's embedding): refused at the entry of the outermost
        call, on every rank. Ids out of range are found in the lookup itself (``forward``), which every
        rank completes, so the mesh stays usable after the error."""
        if type(self).forward is not Embedding2D.forward:  # a subclass's forward takes other arguments
            return None
        ids = args[0] if args else kwargs.get("ids")
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.dim() < 1:
            # uint8 or int16 ids (torch's embedding refuses them too) made a report cast to their dtype: 300 read 44
            return TypeError(
                f"Embedding2D expects integer token ids [b/(d·q), ...] (int64, int32), got {_describe(ids)}"
            )
        return None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if (refused := self.input_refusal((ids,), {})) is not None:
            raise refused
        mesh, n = self.mesh, self.num_embeddings
        # Each rank's report of its ids out of range (a row of _WORDS: how many, the first, where,
        # its ids' shape; zeros: none) travels with the ids over the column, then over rows and depth,
        # so every rank holds every rank's and raises the same error, after the same collectives
        # (none is left waiting; the mesh stays usable). A row of the whole mesh's table per rank.
        table = torch.zeros(mesh.size, _WORDS, dtype=torch.int64, device=ids.device)
        mine = _report(ids, (ids < 0) | (ids >= n))
        if mesh.q > 1:
            packed = torch.cat([ids.reshape(-1), mine.to(ids.dtype)])
            gathered = P.all_gather(packed.contiguous(), mesh, "col", 0).view(mesh.q, -1)
            k, j = mesh.index("depth"), mesh.index("row")
            for i in range(mesh.q):  # the column's members: (k, i, j) for every i
                table[(k * mesh.q + i) * mesh.q + j] = gathered[i, -_WORDS:]
        else:
            table[mesh.index("mesh")] = mine
        for axis in ("row", "depth"):  # the other columns, then the other depth slices
            P.all_reduce(table, mesh, axis)
        if torch.compiler.is_compiling():  # a step of the graph that raises when it runs: no host read, no break
            refuse_if(table[:, 0], f"ValueError: {_outside(n, mesh)}")
        elif table[:, 0].any().item():
            raise self._out_of_range(table)
        if mesh.q == 1:  # the whole table is here: torch's own lookup
            return F.embedding(ids, reduce_grad(self.weight, mesh, ("depth",)), self.padding_idx)
        all_ids = gathered[:, :-_WORDS].reshape(mesh.q * ids.shape[0], *ids.shape[1:])
        start = mesh.index("col") * self.vocab_per_rank
        mine = (all_ids >= start) & (all_ids < start + self.vocab_per_rank)
        local_ids = torch.where(mine, all_ids - start, 0)
        pad = self.padding_idx
        local_pad = pad - start if pad is not None and start <= pad < start + self.vocab_per_rank else None
        weight = reduce_grad(self.weight, mesh, ("depth",))
        partial = F.embedding(local_ids, weight, local_pad) * mine.unsqueeze(-1).to(weight.dtype)
        return reduce_scatter(partial, mesh, "col", 0)

    def _out_of_range(self, table: torch.Tensor) -> ValueError:
        """The error every rank raises when some rank holds ids out of range: ``table`` (the same on
        every rank) names the ranks, how many of their ids, the first and its place."""
        found = []
        for member, (count, first, at, *shape) in zip(self.mesh.members("mesh"), table.tolist(), strict=True):
            if count:
                shape = [d for d in shape if d]
                place = [int(i) for i in torch.unravel_index(torch.tensor(at), tuple(shape))]
                found.append(f"rank {member}: {count} of its ids {shape}, the first {first} at {place}")
        n = self.num_embeddings
        return ValueError(
            f"Embedding2D(num_embeddings={n}): token ids outside [0, {n}) on {len(found)} of {self.mesh.size} "
            f"ranks: {'; '.join(found)} ({self.mesh})"
        )

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """Tied output head: logits ``x·Wᵀ``, ``[b/(d·q), ..., h/q]`` → ``[b/(d·q), ..., ⌈V/q⌉]``.

        The logits of padded vocabulary rows are −inf: they take no part in softmax or in
        ``optimus2d.cross_entropy``. Sends as ``summa_abt`` (the table's layout is that of an
        "abt" weight).
        """
        if x.shape[-1] != self.embedding_dim // self.mesh.q:
            raise ValueError(
                f"Embedding2D.attend: input of shape {tuple(x.shape)} must end in embedding_dim/q = "
                f"{self.embedding_dim // self.mesh.q} on {self.mesh}"
            )
        return tied_logits(x, self.weight, self.mesh, self.num_embeddings)

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}, local={list(self.weight.shape)}, mesh={self.mesh}"


def tied_logits(
    x: torch.Tensor, weight: torch.Tensor, mesh: Mesh, num_embeddings: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x·Eᵀ (+ b)`` for an ``Embedding2D`` table block ``weight`` [⌈V/q⌉, h/q]; padded columns −inf.

    ``bias``: this rank's vocabulary block ``[⌈V/q⌉]`` of a ``[V]`` bias (block j, replicated over
    col and depth: its gradient is summed over them). It is added before the padded columns are
    masked, so its padded entries get no gradient and stay zero.
    """
    rows = x.reshape(-1, x.shape[-1])
    logits = summa_abt(rows, weight.to(x.dtype), mesh).view(*x.shape[:-1], -1)
    if bias is not None:
        logits = logits + reduce_grad(bias, mesh, ("col", "depth")).to(logits.dtype)
    per_rank = weight.shape[0]
    start = mesh.index("row") * per_rank  # the logits' vocabulary block is the row index j
    if start + per_rank <= num_embeddings:  # no padded row in this block
        return logits
    padded = torch.arange(start, start + per_rank, device=x.device) >= num_embeddings
    return logits.masked_fill(padded, float("-inf"))


class TiedHead2D(ShardedModule):
    """An output head whose weight *is* an ``Embedding2D``'s table (GPT-2's tied ``lm_head``, BERT's
    ``cls.predictions.decoder``, BART's ``lm_head``).

    Registers the same Parameter as ``weight``, so the state_dict keeps the head's key and the
    optimizer sees one tensor; forward is ``Embedding2D.attend`` plus the bias, if any.

    Global: x ``[b, ..., h]`` → logits ``[b, ..., V]``; ``bias`` ``[V]``. On rank (k, i, j): x
    ``[b/(d·q), ..., h/q]`` → logits ``[b/(d·q), ..., ⌈V/q⌉]`` (vocabulary block j, padded columns
    −inf); ``bias`` ``[⌈V/q⌉]`` = vocabulary block j (zero-padded), replicated over col and depth,
    like ``Linear2D``'s bias. ``bias`` is given as that block (a Parameter, shared as it is: BERT's
    decoder bias is also ``cls.predictions.bias``); ``from_serial`` makes it from a serial head.
    """

    def __init__(self, embedding: Embedding2D, bias: nn.Parameter | None = None) -> None:
        super().__init__(embedding.mesh)
        self.num_embeddings = embedding.num_embeddings
        self.declare("weight", embedding.shardings["weight"], embedding.weight)
        if bias is None:
            self.register_parameter("bias", None)
            return
        local = bias_sharding(self.num_embeddings).local_shape(self.mesh)
        if not isinstance(bias, nn.Parameter) or tuple(bias.shape) != local:
            raise ValueError(
                f"TiedHead2D: bias must be a Parameter of this rank's vocabulary block {list(local)} "
                f"(vocabulary {self.num_embeddings}) on {self.mesh}, got {_describe(bias)}"
            )
        self.declare("bias", bias_sharding(self.num_embeddings), bias)

    @classmethod
    def from_serial(cls, linear: nn.Linear, embedding: Embedding2D) -> TiedHead2D:
        """The head ``linear`` (whose weight is ``embedding``'s serial table) on the mesh: its weight
        is ``embedding.weight``, its bias, if any, this rank's block of ``linear.bias`` (flag kept)."""
        shape = (embedding.num_embeddings, embedding.embedding_dim)
        if tuple(linear.weight.shape) != shape:
            got = tuple(linear.weight.shape)
            raise ValueError(f"TiedHead2D.from_serial: head weight {got} is not the table's {shape} ({embedding.mesh})")
        bias = None
        if linear.bias is not None:
            local = bias_sharding(embedding.num_embeddings).local_shape(embedding.mesh)
            bias = nn.Parameter(torch.empty(local, device="meta"))
        head = cls(embedding, bias)
        fill_from_serial(head, linear)  # the bias: the table is the embedding's
        return head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tied_logits(x, self.weight, self.mesh, self.num_embeddings, self.bias)

    def extra_repr(self) -> str:
        return f"tied to an Embedding2D({self.num_embeddings}, ...), bias={self.bias is not None}"


def bias_sharding(num_embeddings: int) -> Sharding:
    """A ``[V]`` bias on the logits: vocabulary block j (split over row), like the logits' last dim."""
    return Sharding((("row",),), (num_embeddings,))


_DIMS = 4  # the dims of a rank's ids an out-of-range error names (more: flat)


@torch.compiler.assume_constant_result  # under torch.compile: a constant of the graph, made while tracing
def _outside(n: int, mesh: Mesh) -> str:
    """The compiled check's error, raised on every rank alike after the same collectives; the ranks
    and places of the ids are known only to the eager check, which reads them on the host."""
    where = "run the step eagerly to see where"
    return f"Embedding2D(num_embeddings={n}): token ids outside [0, {n}) on some rank ({mesh}); {where}"


_WORDS = 3 + _DIMS  # a rank's report of its ids out of range: how many, the first, where, their shape


def _report(ids: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """This rank's row of the out-of-range table: zeros, or how many of ``ids`` are ``bad``, the first
    of them, its flat place and ``ids``' shape (flat past ``_DIMS`` dims). No sync: tensor ops only."""
    flat = bad.reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(_WORDS, dtype=torch.int64, device=ids.device)
    count = flat.sum(dtype=torch.int64)
    at = flat.to(torch.uint8).argmax()  # the first bad one (argmax gives the first of equal maxima)
    shape = list(ids.shape) if ids.dim() <= _DIMS else [ids.numel()]
    shape = torch.tensor(shape + [0] * (_DIMS - len(shape)), dtype=torch.int64, device=ids.device)
    first = ids.reshape(-1).index_select(0, at.reshape(1)).long()  # (t[at] would read at on the host)
    row = torch.cat([count.reshape(1), first, at.long().reshape(1), shape])
    return row * (count > 0)


def _describe(x: object) -> str:
    return f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
