"""Every Hugging Face causal-LM family, tiny, through ``parallelize`` on a 2×2 mesh: exact or refused?

    mpiexec -n 4 python benchmarks/families_sweep.py                       # every family (~200)
    mpiexec -n 4 python benchmarks/families_sweep.py --only llama gpt2 --out sweep.json
    mpiexec -n 4 python benchmarks/families_sweep.py --start 0 --count 50 --out part0.json
    python benchmarks/families_sweep.py --merge part*.json --out all.json  # one table of the parts

The families are the entries of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (model type →
class) and any other ``*ForCausalLM`` class that transformers exports. Each gets a tiny config of
its own config class (hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate 64, vocab 128, 64
positions, dropouts 0, eager attention; sub-configs of a composite config shrunk alike), a model
built under ``torch.manual_seed(0)``, and a fixed batch ``input_ids [4, 8]``, ``labels=input_ids``.
Its category:

* ``cannot build``: the tiny model cannot be constructed, or does not run serially (or gives no loss);
* ``refused``: ``parallelize`` raised TypeError/ValueError/NotImplementedError (the modules named,
  and each one's ``forward_problems``, are recorded);
* ``error at convert``: ``parallelize`` raised anything else;
* ``error at run``: the converted model raised during its forward/backward/gather;
* ``timeout``: over ``--limit`` seconds;
* ``exact``: loss, gathered logits and every gradient (gathered by ``serial_state_dict``) within
  ``--tol`` of serial (relative to the tensor's largest entry; a gradient's floor is 1e-3 of the
  largest gradient of the model, as ``tests/helpers.py`` does);
* ``WRONG``: converted and ran, but a number differs: silently wrong.

Every decision is taken on all ranks alike: after each step the ranks agree on a flag (a
non-blocking MPI allreduce, polled); a rank that failed while its peers may wait in a mesh
collective reports the failure on the mesh (``optimus2d.faults.report_failure``), so they raise instead
of hanging, and the next family gets a fresh mesh.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import json
import os
import re
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

TINY = {
    "hidden": 64,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "intermediate": 64,
    "vocab": 128,
    "positions": 64,
    "experts": 4,
    "experts_per_token": 2,
}
# The names configs give these sizes (the first that a config has is set; aliases too: harmless).
FIELDS = {
    "hidden": ("hidden_size", "n_embd", "d_model", "embed_dim", "dim", "model_dim", "hidden_dim", "emb_dim"),
    "layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers"),
    "heads": ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv"),
    "intermediate": (
        "intermediate_size", "n_inner", "ffn_dim", "d_ff", "decoder_ffn_dim", "ffn_hidden_size", "intermediate_dim",
        "moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
    ),
    "vocab": ("vocab_size",),
    "positions": ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length"),
    "experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "experts_per_token": ("num_experts_per_tok", "moe_topk", "num_experts_per_token"),
}  # fmt: skip
# Other sizes that default to a full model's (set where a config has them).
OTHER = {
    "q_lora_rank": 32, "kv_lora_rank": 32, "o_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "n_group": 1, "topk_group": 1, "rotary_dim": 16, "encoder_ffn_dim": 64, "encoder_layers": 2,
    "encoder_attention_heads": 4, "d_inner": 64, "dff": 64, "dim_ff": 64, "intermediate_size_mlp": 64,
    "shared_intermediate_size": 64, "dense_intermediate_size": 64, "moe_shared_expert_intermediate_size": 64,
    "feed_forward_size": 64, "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16,
    "attention_hidden_size": 128, "attention_head_dim": 32, "mamba_headdim": 16, "mamba_d_ssm": 128,
}  # fmt: skip
# A few configs that validate their sizes against each other.
FAMILY_EXTRA = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    "dots1": {"n_shared_experts": 1},
    "dots3_note": {"num_key_value_heads": 4},
    "dots3_note_text": {"num_key_value_heads": 4},
    "reformer": {"is_decoder": True},
}
MAX_PARAMETERS = 5_000_000  # a bigger "tiny" model means a size this script does not know the name of
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
BATCH, SEQ = 4, 8
CATEGORIES = ("exact", "WRONG", "error at run", "timeout", "refused", "error at convert", "cannot build")


# ---- the families ---------------------------------------------------------------------------------
def discover() -> list[tuple[str, str]]:
    """(family, class name): every causal-LM mapping entry, then other exported ``*ForCausalLM``s."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out, classes = [], set()
    for family, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        name = name if isinstance(name, str) else name[0]
        out.append((family, name))
        classes.add(name)
    for name in sorted(dir(transformers)):
        if name.endswith("ForCausalLM") and not name.startswith("Auto") and name not in classes:
            out.append((name, name))
    return out


def _fields(config_cls) -> set[str]:
    import dataclasses
    import inspect

    names = set(getattr(config_cls, "attribute_map", {}) or {})
    if dataclasses.is_dataclass(config_cls):
        names |= {f.name for f in dataclasses.fields(config_cls)}
    try:
        names |= set(inspect.signature(config_cls.__init__).parameters)
    except (TypeError, ValueError):
        pass
    return names


def _get(obj, name):
    try:
        return getattr(obj, name, None)
    except Exception:  # transformers' per-layer attributes raise when read globally
        return None


def tiny_config(config_cls, dtype: torch.dtype, top: bool = True, extra: dict | None = None):
    """``config_cls`` with the TINY sizes under whatever names it uses; sub-configs shrunk alike."""
    default = config_cls()
    names = _fields(config_cls) | set(vars(default))
    kw = {}
    for key, aliases in FIELDS.items():
        for name in aliases:
            if name in names and not isinstance(_get(default, name), (list, tuple, dict)):
                kw[name] = TINY[key]
    if "head_dim" in names:  # multi-head latent attention's rotary reads head_dim as the rope part
        kw["head_dim"] = OTHER["qk_rope_head_dim"] if "qk_rope_head_dim" in names else TINY["hidden"] // TINY["heads"]
    if "qk_rope_head_dim" in names:  # multi-head latent attention expands its keys to every head
        kw.update({n: TINY["heads"] for n in FIELDS["kv_heads"] if n in kw})
    for name, value in OTHER.items():
        if name in names and isinstance(_get(default, name), int):
            kw[name] = value
    for name, value in TOKEN_IDS.items():
        if name in names and _get(default, name) is not None:
            kw[name] = value
    layers = next((_get(default, n) for n in FIELDS["layers"] if isinstance(_get(default, n), int)), None)
    for name in names:
        value = _get(default, name)
        if ("dropout" in name or "pdrop" in name or "drop_rate" in name) and isinstance(value, float):
            kw[name] = 0.0
        settable = not isinstance(getattr(config_cls, name, None), property)
        if isinstance(value, list) and layers and len(value) == layers and name not in kw and settable:
            kw[name] = value[: TINY["layers"]]
    kw.update(extra or {})
    for name, sub_cls in (getattr(config_cls, "sub_configs", None) or {}).items():
        sub = getattr(default, name, None)
        sub_cls = type(sub) if sub is not None and not isinstance(sub, dict) else sub_cls
        try:
            kw[name] = tiny_config(sub_cls, dtype, top=False)
        except Exception:  # keep the default sub-config: the build may still work
            pass
    if top:
        kw["attn_implementation"] = "eager"
    try:
        config = config_cls(**kw)
    except TypeError:  # a config whose __init__ refuses one of the aliases: set what it has instead
        config = default
        for name, value in kw.items():
            if name != "attn_implementation":
                setattr(config, name, value)
        if top:
            config._attn_implementation = "eager"
    layer_types = _get(config, "layer_types")
    layers = next((_get(config, n) for n in FIELDS["layers"] if isinstance(_get(config, n), int)), None)
    if isinstance(layer_types, list) and layers is not None and len(layer_types) != layers:
        config.layer_types = layer_types[:layers]
    return config


def build(family: str, class_name: str, dtype: torch.dtype):
    """(model, config) of the family's class on its tiny config, built under manual_seed(0)."""
    import transformers

    model_cls = getattr(transformers, class_name)
    config = tiny_config(model_cls.config_class, dtype, extra=FAMILY_EXTRA.get(family))
    with torch.device("meta"):
        count = sum(p.numel() for p in model_cls(config).parameters())
    if count > MAX_PARAMETERS:
        raise RuntimeError(f"the tiny config still makes {count:,} parameters (a size left at its default)")
    torch.manual_seed(0)
    model = model_cls(config).to(dtype)
    return model, config


def vocab_of(config) -> int:
    for c in (config, getattr(config, "text_config", None), getattr(config, "get_text_config", lambda: None)()):
        v = getattr(c, "vocab_size", None)
        if isinstance(v, int):
            return v
    return TINY["vocab"]


def batch(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, min(vocab, TINY["vocab"]), (BATCH, SEQ), generator=g)


def serial_step(model, ids):
    """(loss, logits, grads by parameter name) of the serial model on ids, labels=ids."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    loss = getattr(out, "loss", None)
    if loss is None:
        raise RuntimeError("the serial model gives no loss for labels=")
    if loss.dim():
        loss = loss.mean()
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in _params(model)}
    return loss.detach(), out.logits.detach(), grads


def _params(model):
    return list(model.named_parameters(remove_duplicate=False))


# ---- agreement across ranks -----------------------------------------------------------------------
class Agreement:
    """Every rank's local outcome of a step → the same decision on all ranks, without hanging on a peer
    that waits in a mesh collective: after ``grace`` s a failed rank reports on the mesh."""

    def __init__(self):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup() if MPI.COMM_WORLD.Get_size() > 1 else None

    def __call__(self, failed: bool, mesh=None, error=None, grace: float = 3.0, limit: float = 600.0):
        """(any rank failed, any rank reported on the mesh, every rank's error text)."""
        reported = False
        if self.comm is None:
            return failed, reported, [error]
        import numpy as np

        send, recv = np.array([int(failed)], dtype=np.int64), np.zeros(1, dtype=np.int64)
        request = self.comm.Iallreduce(send, recv, op=self.MPI.MAX)
        start = time.monotonic()
        while not request.Test():
            waited = time.monotonic() - start
            if failed and not reported and waited > grace and mesh is not None:
                import optimus2d

                optimus2d.faults.report_failure(error or "failed")  # the peers' mesh waits raise PeerFailedError
                reported = True
            if waited > limit:
                raise SystemExit(f"rank {self.comm.Get_rank()}: the ranks did not agree within {limit} s")
            time.sleep(0.005)
        info = self.comm.allgather((reported, error))
        return bool(recv[0]), any(r for r, _ in info), [e for _, e in info]


class FamilyTimeoutError(Exception):
    pass


def _alarm(signum, frame):
    raise FamilyTimeoutError("over the per-family time limit")


# ---- one family -----------------------------------------------------------------------------------
def _short(err: BaseException, n: int = 300) -> str:
    return f"{type(err).__name__}: {err}"[:n]


def _first(errors) -> str:
    return next((e for e in errors if e), "")


def rel(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf")
    scale = max(want.abs().max().item() if want.numel() else 0.0, floor)
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    return diff / scale if scale else diff


_REFUSED_LINE = re.compile(r"^\s+(.+?) \(([\w.]+)\): (.*)$")


def refusal_info(message: str, serial) -> tuple[list[str], list[str], list[str]]:
    """(module classes named, paths, every problem pattern) of a parallelize refusal. The patterns
    come from ``optimus2d.convert.forward_problems`` of each named module (not only the 4 the message shows)."""
    import optimus2d

    classes, paths, patterns = [], [], []
    for line in message.splitlines():
        m = _REFUSED_LINE.match(line)
        if not m:
            continue
        path, cls, why = m.groups()
        paths.append(path)
        if cls not in classes:
            classes.append(cls)
        problems = []
        if why.startswith("its forward"):
            try:
                module = serial if path == "the model itself" else serial.get_submodule(path)
                problems = list(optimus2d.convert.forward_problems(module))
            except Exception:
                problems = []
            if not problems:
                problems = why[len("its forward ") :].split("; ")
        else:
            problems = [why]
        for problem in problems:
            patterns.append(pattern_of(problem))
    if not patterns:
        patterns = [pattern_of(message.splitlines()[0] if message else "")]
    return classes, paths, sorted(set(patterns))


def pattern_of(problem: str) -> str:
    """A problem text with its place and code left out: "calls .chunk()", "reshapes by a global size"."""
    problem = re.sub(r"^[\w.]+, line \d+: ", "", problem.strip())
    problem = problem.split(", not known to act on blocks")[0]
    problem = re.sub(r"^(has \w+)=\d+, not divisible.*", r"\1 not divisible by q", problem)
    problem = re.sub(r"^holds .* and has no converter.*", "holds tensors and has no converter", problem)
    problem = re.sub(
        r"^parallelize: one parameter is shared by .*", "parallelize: a parameter shared unsupported", problem
    )
    cut = problem.find(" (")
    return problem[:cut] if cut > 0 else problem


def run_family(family: str, class_name: str, mesh, agree: Agreement, args) -> tuple[dict, bool]:
    """This family's record (the same on every rank) and whether the mesh must be rebuilt."""
    import optimus2d

    dtype = getattr(torch, args.dtype)
    record = {"family": family, "class": class_name, "category": None, "detail": ""}
    start = time.monotonic()
    signal.signal(signal.SIGALRM, _alarm)

    def step(fn):
        """(value, failed?, error text) of fn() under the family's remaining time."""
        left = max(1, int(args.limit - (time.monotonic() - start)))
        signal.alarm(left)
        try:
            return fn(), False, None, None
        except BaseException as err:  # a family's failure, whatever it is, is a result
            if isinstance(err, KeyboardInterrupt):
                raise
            return None, True, _short(err, 2000), err
        finally:
            signal.alarm(0)

    # 1. the serial model, and its run
    def serial_part():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, config = build(family, class_name, dtype)
            ids = batch(vocab_of(config))
            loss, logits, grads = serial_step(model, ids)
            loss2, logits2, _ = serial_step(model, ids)
            train = True
            if not (torch.equal(loss, loss2) and torch.equal(logits, logits2)):  # random in train mode
                model.eval()
                loss, logits, grads = serial_step(model, ids)
                train = False
            model.zero_grad(set_to_none=True)
        return model, ids, loss, logits, grads, train

    value, failed, error, _ = step(serial_part)
    failed, _, errors = agree(failed, None, error)
    if failed:
        record.update(category="cannot build", detail=_first(errors)[:300])
        return _done(record, start), False
    serial, ids, loss_ref, logits_ref, grads_ref, train = value
    record["mode"] = "train" if train else "eval (serial random in train mode)"
    record["parameters"] = sum(p.numel() for p in serial.parameters())

    # 2. parallelize
    def convert():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return optimus2d.parallelize(copy.deepcopy(serial), mesh)

    parallel, failed, error, err = step(convert)
    refused_here = isinstance(err, (TypeError, ValueError, NotImplementedError))
    failed, reported, errors = agree(failed, mesh, error if not refused_here else "refused: " + (error or ""))
    if failed:
        message = _first(errors)
        if message.startswith("refused: "):
            message = message[len("refused: ") :]
            classes, paths, patterns = refusal_info(str(err) if err is not None else message, serial)
            record.update(category="refused", detail=message[:300], classes=classes, paths=paths, patterns=patterns)
        else:
            record.update(category="error at convert", detail=message[:300])
        return _done(record, start), reported

    # 3. the converted model on the same batch
    def parallel_part():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not train:
                parallel.eval()
            local = optimus2d.scatter_batch(ids, mesh)
            out = parallel(input_ids=local, labels=local, use_cache=False)
            loss = out.loss.mean() if out.loss.dim() else out.loss
            loss.backward()
            logits = optimus2d.gather(out.logits.contiguous(), mesh).detach()  # detach() drops the block's tag
            return loss.detach(), logits, parallel_grads(parallel)

    value, failed, error, _ = step(parallel_part)
    failed, reported, errors = agree(failed, mesh, error)
    if failed:
        timed_out = any(e and e.startswith("FamilyTimeoutError") for e in errors)
        record.update(category="timeout" if timed_out else "error at run", detail=_first(errors)[:300])
        return _done(record, start), reported
    loss, logits, grads = value

    # 4. compare (every rank holds the gathered tensors: the same verdict everywhere)
    vocab = logits_ref.shape[-1]
    errs = {"loss": rel(loss, loss_ref), "logits": rel(logits[..., :vocab], logits_ref)}
    scale = max((g.abs().max().item() for g in grads_ref.values() if g.numel()), default=0.0)
    worst, worst_name, missing = 0.0, None, []
    for name, g in grads_ref.items():
        if name not in grads:
            missing.append(name)
            continue
        e = rel(grads[name], g, 1e-3 * scale)
        if e > worst:
            worst, worst_name = e, name
    errs["grad"] = worst
    record["errors"] = {k: float(f"{v:.3e}") for k, v in errs.items()}
    record["worst_grad"] = worst_name
    bad = {k: v for k, v in errs.items() if not v <= args.tol}
    if missing:
        record.update(category="WRONG", detail=f"gradients missing from serial_state_dict: {missing[:5]}")
    elif bad:
        where = f" (worst gradient: {worst_name})" if "grad" in bad else ""
        record.update(category="WRONG", detail=", ".join(f"{k} {v:.2e}" for k, v in bad.items()) + where)
    else:
        record.update(category="exact", detail=", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    return _done(record, start), False


def parallel_grads(parallel) -> dict[str, torch.Tensor]:
    """Every gradient as a full tensor under the serial keys: each parameter's block overwritten by
    its gradient's (zeros where none), ``serial_state_dict`` (collective), and put back. A parameter
    is a DTensor whose gradient is one too, laid out alike: the block is its ``to_local()``, which
    shares the storage (a swap of ``.data`` leaves that block as it was: every gradient was read as its
    weight here until this was found)."""
    from torch.distributed.tensor import DTensor

    import optimus2d

    def block(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    params = list(parallel.parameters())  # each Parameter once (tied ones included once)
    with torch.no_grad():
        saved = [block(p).clone() for p in params]
        try:
            for p in params:
                if isinstance(p, DTensor) and p.grad is not None and p.grad.placements != p.placements:
                    raise ValueError(f"a gradient laid out as {p.grad.placements}, its parameter {p.placements}")
                block(p).copy_(block(p.grad) if p.grad is not None else torch.zeros_like(block(p)))
            state = {name: t.clone() for name, t in optimus2d.serial_state_dict(parallel).items()}
        finally:
            for p, data in zip(params, saved, strict=True):
                block(p).copy_(data)
    return state


def _done(record: dict, start: float) -> dict:
    record["seconds"] = round(time.monotonic() - start, 2)
    return record


# ---- report ---------------------------------------------------------------------------------------
def report(records: list[dict], out: str | None) -> None:
    width = max((len(r["family"]) for r in records), default=6)
    print(f"\n{'family':<{width}}  {'category':<16}  detail")
    for r in records:
        detail = r["detail"].replace("\n", " ")
        if r["category"] == "refused":
            detail = f"[{', '.join(r.get('classes', []))}] " + "; ".join(r.get("patterns", []))
        print(f"{r['family']:<{width}}  {r['category']:<16}  {detail[:200]}")
    counts = {c: sum(r["category"] == c for r in records) for c in CATEGORIES}
    print(f"\n{len(records)} families: " + ", ".join(f"{c} {n}" for c, n in counts.items() if n))
    for c in CATEGORIES:
        names = [r["family"] for r in records if r["category"] == c]
        if names:
            print(f"  {c} ({len(names)}): {' '.join(names)}")
    patterns: dict[str, list[str]] = {}
    for r in records:
        for p in r.get("patterns", []):
            patterns.setdefault(p, []).append(r["family"])
    if patterns:
        print("\nrefusal patterns (families whose refused modules show it):")
        for p, fams in sorted(patterns.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(fams):4d}  {p[:90]}")
    if out:
        meta = {
            "transformers": importlib.import_module("transformers").__version__,
            "torch": torch.__version__,
            "tiny": TINY,
            "counts": counts,
        }
        Path(out).write_text(json.dumps({"meta": meta, "families": records}, indent=1))
        print(f"\nwrote {out}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="families (model type or class name) to run")
    parser.add_argument("--start", type=int, default=0, help="first family of the sorted list")
    parser.add_argument("--count", type=int, default=None, help="how many families from --start")
    parser.add_argument("--out", help="write the records as JSON (rewritten after every family)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--tol", type=float, default=None, help="exact if every error ≤ tol (default 1e-4)")
    parser.add_argument("--limit", type=float, default=180.0, help="seconds per family")
    parser.add_argument("--list", action="store_true", help="print the families and exit")
    parser.add_argument("--merge", nargs="+", help="JSON files of earlier runs: one report of them all")
    args = parser.parse_args(argv)
    args.tol = args.tol if args.tol is not None else 1e-4  # float64 too: HF norms compute in fp32

    if args.merge:
        records = {}
        for path in args.merge:
            for r in json.loads(Path(path).read_text())["families"]:
                records[r["family"]] = r
        report(sorted(records.values(), key=lambda r: r["family"]), args.out)
        return

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    families = sorted(discover())
    if args.only:
        wanted = set(args.only)
        families = [(f, c) for f, c in families if f in wanted or c in wanted]
    families = families[args.start : None if args.count is None else args.start + args.count]
    if args.list:
        print("\n".join(f"{f} {c}" for f, c in families))
        return

    import optimus2d

    torch.set_num_threads(1)
    world = optimus2d.init(timeout=120)
    rank = world.rank
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    agree = Agreement()
    mesh = optimus2d.Mesh(q=2, depth=1)
    records, t0 = [], time.monotonic()
    for i, (family, class_name) in enumerate(families):
        record, broken = run_family(family, class_name, mesh, agree, args)
        records.append(record)
        if rank == 0:
            print(
                f"[{i + 1}/{len(families)} {time.monotonic() - t0:6.0f}s] {family}: {record['category']} "
                f"({record['seconds']} s) {record['detail'][:150]!r}",
                flush=True,
            )
            if args.out:
                Path(args.out).write_text(json.dumps({"meta": {"partial": True}, "families": records}, indent=1))
        if broken:  # a failure was reported on this mesh: its operations may be abandoned
            mesh = optimus2d.Mesh(q=2, depth=1)
        gc.collect()
    if rank == 0:
        report(records, args.out)
        print(f"total {time.monotonic() - t0:.0f} s", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise
