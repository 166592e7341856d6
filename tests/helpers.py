"""Shared test helpers: comparisons against serial torch, made the same way on every rank."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are zero), computed in fp64. A DTensor (a
    converted model's parameter or gradient) is compared as the serial tensor it stands for, or as
    this rank's block where ``want`` has the block's shape."""
    got, want = _as_compared(got, want), _as_compared(want, got)
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    return diff / scale if scale else diff


def _as_compared(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if not isinstance(got, DTensor):
        return got
    if isinstance(want, DTensor):  # two of one layout (a compiled model's and an eager one's): blocks
        return got.to_local()
    return got.full_tensor() if got.shape == want.shape else got.to_local()


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5, what: str = "") -> None:
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


def assert_state_close(got: dict, want: dict, tol: float = 1e-5) -> None:
    assert list(got) == list(want), f"keys {list(got)} != {list(want)}"
    for key in want:
        assert_close(got[key], want[key], tol, key)


def step_both(serial, parallel, x, mesh, lr=0.1, optimizer=torch.optim.SGD):
    """fwd+bwd+optimizer step of a serial module and its 2D twin on the same full input.

    Returns (output gathered, serial output, input grad gathered, serial input grad). The loss
    weighs every output element differently, so a misplaced block cannot cancel out.
    """
    from optimus2d import gather, scatter

    x_serial = x.clone().requires_grad_()
    y_serial = serial(x_serial)
    torch.manual_seed(2)
    probe = torch.randn_like(y_serial)
    (y_serial * probe).sum().backward()
    optimizer(serial.parameters(), lr=lr).step()

    x_full = x.clone().requires_grad_()
    y_local = parallel(scatter(x_full, mesh))
    (y_local * scatter(probe, mesh)).sum().backward()
    optimizer(parallel.parameters(), lr=lr).step()
    # x_full.grad: scatter's backward gathered every rank's block into the full gradient
    return gather(y_local.detach(), mesh), y_serial, x_full.grad, x_serial.grad


def check_against_serial(serial, parallel, x, mesh, tol=1e-5, optimizer=torch.optim.SGD):
    """Outputs, input gradients and parameters after one step, all within ``tol``."""
    from optimus2d import serial_state_dict

    y, y_ref, dx, dx_ref = step_both(serial, parallel, x, mesh, optimizer=optimizer)
    state = serial_state_dict(parallel)
    assert_close(y, y_ref, tol, "output")
    assert_close(dx, dx_ref, tol, "input grad")
    assert_state_close(state, serial.state_dict(), tol)


def assert_grads_like_serial(serial, parallel, mesh, tol: float = 1e-4) -> float:
    """Every gradient of ``parallel``, assembled from the ranks' blocks, equal to ``serial``'s: each
    within ``tol`` of its own size, or of 1e-3 of the largest (an attention key bias has none but
    rounding). Returns the largest serial gradient element."""
    from optimus2d.comm import unshard
    from optimus2d.comm.dtensor import local, whole
    from optimus2d.layers.base import param_sharding

    grads = {}
    for name, p in parallel.named_parameters():
        if p.grad is not None:
            sharding = param_sharding(p)  # None: replicated, or split by torch's parallelize_module (whole)
            grads[name] = unshard(local(p.grad).contiguous(), mesh, sharding) if sharding is not None else whole(p.grad)
    want = {name: p.grad for name, p in serial.named_parameters() if p.grad is not None}
    assert set(grads) == set(want)
    scale = max(g.abs().max().item() for g in want.values())
    for name, g in want.items():
        err = (grads[name] - g).abs().max().item() / max(g.abs().max().item(), 1e-3 * scale)
        assert err <= tol, f"gradient of {name}: relative error {err:.3e}"
    return scale


def compare_step(serial, parallel, mesh, tol: float = 1e-4) -> None:
    """The gradients (``assert_grads_like_serial``), their norm, then the model after one AdamW step
    with eps a thousandth of the largest gradient (a gradient that is rounding alone moves nothing,
    where a smaller eps would make it a step of ±lr): equal to serial."""
    from optimus2d import clip_grad_norm_, serial_state_dict

    scale = assert_grads_like_serial(serial, parallel, mesh, tol)
    norm_ref = torch.nn.utils.clip_grad_norm_([p for p in serial.parameters() if p.grad is not None], 1e9)
    assert_close(clip_grad_norm_([p for p in parallel.parameters() if p.grad is not None], 1e9, mesh), norm_ref, 1e-5)
    for model in (serial, parallel):
        trained = [p for p in model.parameters() if p.requires_grad]
        torch.optim.AdamW(trained, lr=1e-2, eps=1e-3 * scale).step()
    state = serial_state_dict(parallel)
    assert list(state) == list(serial.state_dict())
    for key, value in serial.state_dict().items():
        assert_close(state[key], value, tol, key)


# ---- pipelines ---------------------------------------------------------------------------------
_STAGE_PIPES: dict = {}


def stage_pipe(stages, q, depth=1, dp=1):
    """``optimus2d.pipeline.stage_meshes(stages, q, depth, dp=dp)``, built once per session for these
    arguments (collective: every rank runs the same tests in the same order, so asks alike)."""
    from optimus2d.pipeline import stage_meshes

    key = (stages, q, depth, dp)
    if key not in _STAGE_PIPES:
        _STAGE_PIPES[key] = stage_meshes(stages, q, depth, dp=dp)
    return _STAGE_PIPES[key]


def as_serial(chunks, tensors=None) -> dict:
    """``tensors(param)`` (a block per parameter; default its gradient, zeros where it has none) under
    the chunks' serial keys, full: collective over the chunks' mesh. Works through wrappers that
    rewrite keys (``serial_state_dict`` finds each tensor's owner)."""
    from optimus2d import serial_state_dict
    from optimus2d.comm.dtensor import local

    tensors = tensors or (lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
    out = {}
    for chunk in chunks if isinstance(chunks, (list, tuple)) else [chunks]:
        twin = copy.deepcopy(chunk)  # the mesh is shared, not copied
        for p, twin_p in zip(chunk.parameters(), twin.parameters(), strict=True):  # a deep copy drops .grad
            with torch.no_grad():  # into the block (a DTensor's .data would not reach its local tensor)
                local(twin_p).copy_(local(tensors(p)))
        out.update(serial_state_dict(twin))
    return out


def assert_chunks_match(labels, grads, states, ref_grads, ref_state, tol, adam_tol) -> None:
    """Each chunk's gradients and parameters after the step (``as_serial``/``serial_state_dict``
    dicts, one per chunk, named by ``labels``) against the serial model's, key by key; every chunk
    holds some parameter."""
    for label, grad, state in zip(labels, grads, states, strict=True):
        assert grad, f"{label}: no parameters"
        for key, g in grad.items():
            assert_close(g, ref_grads[key], tol, f"{label} grad {key}")
            assert_close(state[key], ref_state[key], adam_tol, f"{label} AdamW {key}")


def causal_lm_schedule_step(pipe, cut, name, ids, n, hidden, logits):
    """One training step of a causal LM cut into ``cut`` (one chunk per torch stage: ids in, logits of
    width ``logits`` out) under torch's schedule ``name``, ``n`` micro-batches of ``ids`` ``[b, s]``,
    HF's ``labels=`` loss: this rank's chunks (converted on ``pipe.mesh``) and the loss (the sum of
    the micro-batches', on the ranks of the last chunk; else None)."""
    import optimus2d
    from optimus2d.pipeline import SCHEDULES, pipeline_stage
    from optimus2d.pipeline.models.llama import causal_lm_loss, causal_lm_targets

    cls, indices = SCHEDULES[name]
    stage_ids = indices(pipe.stage, pipe.stages)
    num_stages = pipe.stages * len(stage_ids)
    (b, s), chunks, stages = ids.shape, [], []
    for sid in stage_ids:
        chunk = optimus2d.parallelize(cut[sid], pipe.mesh)
        first, last = sid == 0, sid == num_stages - 1
        stages.append(
            pipeline_stage(
                chunk, pipe, microbatch_shape=(b // n, s) if first else (b // n, s, hidden),
                output_shape=(b // n, s, logits) if last else (b // n, s, hidden),
                stage_index=sid, num_stages=num_stages, token_ids=first,
            )
        )  # fmt: skip
        chunks.append(chunk)
    target, count = causal_lm_targets(ids, pipe.mesh)
    loss_fn = causal_lm_loss(pipe.mesh, count)
    schedule = cls(stages if len(stages) > 1 else stages[0], n_microbatches=n, loss_fn=loss_fn, scale_grads=False)
    losses: list[torch.Tensor] = []
    last = num_stages - 1 in stage_ids
    args = (optimus2d.scatter_batch(ids, pipe.mesh),) if 0 in stage_ids else ()
    schedule.step(*args, target=target if last else None, losses=losses if last else None)
    return chunks, (torch.stack(losses).sum() if last else None)


def optim_state(model, opt) -> dict:
    """``opt``'s state of ``model`` (serial) by state_dict key, without the step count."""
    names = {id(p): k for k, p in model.named_parameters()}
    return {names[id(p)]: {k: v for k, v in s.items() if k != "step"} for p, s in opt.state.items()}


def shared_tmp(tmp_path_factory, name: str) -> Path:
    """A fresh directory made by rank 0, its path on every rank (collective over the world). One
    directory for all: each rank's own pytest session would make (and prune, keeping 3) its own
    numbered base directory, and could delete another rank's."""
    import torch.distributed as dist

    box = [str(tmp_path_factory.mktemp(name)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def check_stage_checkpoints(pipe, chunks, opt, whole, fresh, ref_state, ref_optim, tmp_path_factory, tol, adam_tol,
                            eps=1e-8):  # fmt: skip
    """A pipelined checkpoint against the serial model after the same step (``ref_state``; ``ref_optim``:
    key → Adam's moments): ``save_stages`` of this rank's ``chunks`` and ``opt`` → ``checkpoint.load``
    into ``whole`` (the serial model, fresh) on ``pipe.mesh`` → ``checkpoint.save`` of it →
    ``load_stages`` into ``fresh`` (this rank's stage, fresh); and ``checkpoint.read`` in this process
    alone. Weights within ``adam_tol``, moments within ``tol``. Returns the fresh stage's optimizer."""

    import optimus2d
    from optimus2d.checkpoint.stages import load_stages, save_stages

    base = shared_tmp(tmp_path_factory, "stages")
    stages_path, whole_path = f"{base}/stages", f"{base}/whole"
    # the stages → one checkpoint of the whole model, loaded into the whole model on one stage's mesh
    save_stages(stages_path, chunks, opt, pipe=pipe)
    whole = optimus2d.parallelize(whole, pipe.mesh)
    whole_opt = torch.optim.AdamW(whole.parameters(), lr=1e-2, eps=eps)
    optimus2d.checkpoint.load(stages_path, whole, whole_opt)
    loaded = optimus2d.serial_state_dict(whole)
    loaded_optim = as_serial([whole], lambda p: whole_opt.state[p]["exp_avg_sq"])
    # the whole model on one mesh → its checkpoint (each stage mesh a replica: one writes) → the stages
    optimus2d.checkpoint.save(whole_path, whole, whole_opt)
    fresh = optimus2d.parallelize(fresh, pipe.mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, eps=eps)
    load_stages(whole_path, fresh, fresh_opt)
    back = optimus2d.serial_state_dict(fresh)
    back_optim = as_serial([fresh], lambda p: fresh_opt.state[p]["exp_avg"])
    read = optimus2d.checkpoint.read(stages_path)  # in this process alone

    assert set(read["model"]) == set(ref_state) and set(read["optimizer"]) == set(ref_optim)
    for key, value in ref_state.items():
        assert_close(read["model"][key], value, adam_tol, f"read {key}")
        assert_close(loaded[key], value, adam_tol, f"loaded on one mesh {key}")
        for what in ("exp_avg", "exp_avg_sq"):
            assert_close(read["optimizer"][key][what], ref_optim[key][what], tol, f"read {what} {key}")
        assert_close(loaded_optim[key], ref_optim[key]["exp_avg_sq"], tol, f"loaded exp_avg_sq {key}")
    assert back and set(back) < set(ref_state)
    for key, value in back.items():
        assert_close(value, ref_state[key], adam_tol, f"back in the stages {key}")
        assert_close(back_optim[key], ref_optim[key]["exp_avg"], tol, f"back exp_avg {key}")
    return fresh_opt


FAST_S = 20.0  # a refusal must come this fast: from a check, not from a wait running out


def raises_fast(exc, match: str, fn) -> str:
    """``pytest.raises(exc, match=match)`` around ``fn()``, within ``FAST_S``; the message."""
    start = time.monotonic()
    with pytest.raises(exc, match=match) as info:
        fn()
    took = time.monotonic() - start
    assert took < FAST_S, f"took {took:.1f} s to fail"
    return str(info.value)


def context_mask(kind: str, s: int) -> torch.Tensor:
    """The context-parallel tests' masks over ``s`` tokens: "causal", "image" (causal text with one
    bidirectional image span) or "documents" (three packed causal documents)."""
    from optimus2d import context

    if kind == "causal":
        return context.causal_mask(s)
    if kind == "image":
        return context.image_text_mask(s, [(s // 8, s // 2)])
    return context.document_mask([s // 4, s // 2, s - s // 4 - s // 2])


def torch_rms_norms(model, hidden: int, cls_name: str):
    """``model`` with every Hugging Face ``cls_name`` norm (which computes in float32 whatever the
    dtype: 1e-8 apart from float64) replaced by ``nn.RMSNorm`` in float64, weights ``1 + 0.3·randn``
    (a norm at 1 would hide a wrong scale), so a float64 model stays exact against serial."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child).__name__ == cls_name:
                norm = torch.nn.RMSNorm(hidden, eps=child.variance_epsilon, dtype=torch.float64)
                with torch.no_grad():
                    norm.weight.copy_(1 + 0.3 * torch.randn(hidden, dtype=torch.float64))
                setattr(module, name, norm)
    return model


class Scale(torch.nn.Module):
    """A scalar it multiplies by, element by element: ``parallelize`` keeps it, its scalar whole on
    every rank and its gradient summed over the mesh by a hook."""

    def __init__(self) -> None:
        super().__init__()
        self.s = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return x * self.s
