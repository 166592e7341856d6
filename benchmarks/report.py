"""Tables and plots from the JSON the other subcommands wrote under benchmarks/results/.

    python -m benchmarks report          # writes benchmarks/results/report.md and *.png

Plots need matplotlib (``pip install -e '.[bench]'``); without it the tables are still written.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import optimus2d


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The results folder is the entry point's ``--results``."""


def _load(folder: Path) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}


def _peer_table(name: str, data: dict) -> list[str]:
    rows = data["rows"]
    serial_act = data.get("serial_activation_bytes") or 0
    p = data["ranks"]
    lines = [
        f"### {name}",
        "",
        f"`{_command(data)}`",
        "",
        "| peer | fwd+bwd ms | ÷ first | fwd ms | ÷ first | tokens/s | TFLOP/s a rank | act B/rank | ÷ serial/p "
        "| largest batch | elements/rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        act_ratio = f"{r['activation_bytes'] / (serial_act / p):.3f}" if serial_act else "—"
        elements = r.get("elements_measured", r.get("elements_formula"))
        lines.append(
            f"| {r['peer']} | {r['train_ms']:.1f} | {r['train_vs_first']:.2f} | {r['infer_ms']:.1f} | "
            f"{r['infer_vs_first']:.2f} | {r['tokens_per_s']:.0f} | {_tflops(r)} | {r['activation_bytes']:,} | "
            f"{act_ratio} | "
            f"{r['largest_batch']} | {f'{elements:,}' if elements is not None else '—'} |"
        )
    peaks = [r for r in rows if r.get("peak_step_bytes")]
    if peaks:
        lines += [
            "",
            "Peak of a fwd+bwd step (CUDA allocator, beyond what it held before): "
            + ", ".join(f"{r['peer']} {r['peak_step_bytes'] / 2**20:,.0f} MiB" for r in peaks),
        ]
    return [*lines, ""]


def _tflops(row: dict) -> str:
    value = row.get("tflops_per_rank")
    return f"{value:.3f}" if value else "—"


def _command(data: dict) -> str:
    config = dict(data["config"])
    command, depth, name = config.pop("command"), config.pop("depth", 1), config.pop("name", None)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in config.items() if k not in ("linear", "results"))
    prefix = f"mpiexec -n {data['ranks']} python -m benchmarks" + (f" --depth {depth}" if depth > 1 else "")
    return f"{prefix}{f' --name {name}' if name else ''} {command} {flags}".strip()


def _calibration_table(data: dict) -> list[str]:
    rates = "; ".join(
        f"batch {b}: {hw['flops'] / 1e9:.1f} GFLOP/s a rank, {hw['bandwidth'] / 1e9:.2f} GB/s, "
        f"{hw['latency'] * 1e6:.0f} µs a sync point"
        + (f" after {hw['latency_work'] * 1e3:.1f} ms of work (× √(work / that))" if hw.get("latency_work") else "")
        for b, hw in data["hardware"].items()
    )
    lines = [
        "### Cost model against measurement",
        "",
        f"`{_command(data)}`: {rates}",
        "",
        "| batch | peer | measured ms | predicted ms | error |",
        "|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['batch']} | {r['peer']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | {r['error']:+.0%} |"
        )
    return [*lines, ""]


def _ceiling_table(data: dict) -> list[str]:
    n = data["size"]
    lines = [f"### Matmul ceiling: {n}×{n}×{n} on {data['device']}", "", "| dtype | TFLOP/s |", "|---|---|"]
    return [*lines, *(f"| {r['dtype']} | {r['tflops']:.2f} |" for r in data["rows"]), ""]


def _transport_table(name: str, data: dict) -> list[str]:
    transports = [t for t in ("mpi", "gloo") if f"{t}_ms" in data["rows"][0]]
    lines = [
        f"### {name}: ms a sync point, beyond {data['work_ms']:.2f} ms of work (auto took {data.get('auto', '?')})",
        "",
        f"`{_command(data)}`",
        "",
        "| op | bytes | " + " | ".join(transports) + " | gloo ÷ mpi |",
        "|---|---|" + "---|" * (len(transports) + 1),
    ]
    for r in data["rows"]:
        ratio = f"{r['gloo_over_mpi']:.2f}" if "gloo_over_mpi" in r else "—"
        cells = " | ".join(f"{r[f'{t}_ms']:.2f}" for t in transports)
        lines.append(f"| {r['op']} | {r['bytes']:,} | {cells} | {ratio} |")
    if data.get("sync_after_work"):
        lines += ["", f"A 64-byte exchange over {data.get('auto', '?')} after more or less work:", ""]
        lines += ["| matmul rows | work ms | sync point ms | ÷ work |", "|---|---|---|---|"]
        for r in data["sync_after_work"]:
            share = r["sync_ms"] / r["work_ms"] if r["work_ms"] > 0 else float("nan")
            lines.append(f"| {r['rows']} | {r['work_ms']:.2f} | {r['sync_ms']:.2f} | {share:.2f} |")
    return [*lines, ""]


def _breakdown_table(name: str, data: dict) -> list[str]:
    """Step, compute alone and communication alone, for 2D and 1D (``benchmarks/breakdown.py``)."""
    lines = [f"### {name}", "", f"`{_command(data)}`", ""]
    lines += ["| peer | step ms | compute alone | exposed comm | comm alone | elements/rank | exposed ms/MiB |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(
            f"| {r['peer']} | {r['step_ms']:.1f} | {r['compute_ms']:.1f} | {r['exposed_ms']:.1f} | "
            f"{r['comm_alone_ms']:.1f} | {r['elements']:,} | {r['exposed_ms_per_mib']:.2f} |"
        )
    kept = data["times_ms"].get("  compute alone, activation kept")
    if kept is not None:
        lines += ["", f"2D compute alone with the activation kept, not recomputed: {kept:.1f} ms."]
    kernels = data.get("compute_kernels_ms")
    if kernels:  # the compute-alone steps by kernel, side by side
        peers = list(kernels)
        lines += [
            "",
            "Compute alone by kernel on rank 0 alone (the others waiting), ms a step (self CPU time, torch.profiler, "
            "median of 5 steps):",
            "",
        ]
        lines += ["| kernel | " + " | ".join(peers) + " |", "|---|" + "---|" * len(peers)]
        for op in kernels[peers[0]]:
            lines.append(f"| {op} | " + " | ".join(f"{kernels[p][op]:.2f}" for p in peers) + " |")
    return [*lines, ""]


def _waits_table(name: str, data: dict) -> list[str]:
    """Every MPI wait of a step timed, per algorithm (``benchmarks/waits.py``)."""
    lines = [f"### {name}: where the step waits", "", f"`{_command(data)}`", ""]
    lines += ["| algorithm | step ms | elements/rank | waits a rank | waited ms (every rank) | costliest waits |"]
    lines += ["|---|---|---|---|---|---|"]
    for algorithm, a in data["algorithms"].items():
        waits = sorted(set(a["waits_per_step"]))
        waited = ", ".join(f"{ms:.1f}" for ms in a["waited_ms_by_rank"])
        top = sorted(a["by_kind_ms"].items(), key=lambda kv: -kv[1])[:3]
        kinds = "; ".join(f"{kind} ({a['count_by_kind'][kind]}×) {ms:.1f} ms" for kind, ms in top)
        kinds += f" (rank {a['longest_rank']}, which waited longest)"
        counts = "–".join(map(str, waits))
        lines.append(f"| {algorithm} | {a['step_ms']:.1f} | {a['elements']:,} | {counts} | {waited} | {kinds} |")
    return [*lines, ""]


def _plots(results: dict[str, dict], folder: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(no plots: matplotlib is not installed; `pip install -e '.[bench]'`)"]
    written = []
    timed = {k: v for k, v in results.items() if v.get("rows") and "train_ms" in v["rows"][0]}
    if timed:  # speed and memory of every peer, per benchmark
        height = 0.5 * sum(len(v["rows"]) for v in timed.values()) + 2
        fig, (speed, memory, comm) = plt.subplots(1, 3, figsize=(17, height))
        labels, tokens, acts, elements = [], [], [], []
        for name, data in timed.items():
            for r in data["rows"]:
                labels.append(f"{name}: {r['peer']}")
                tokens.append(r["tokens_per_s"])
                serial = data.get("serial_activation_bytes") or 0
                acts.append(r["activation_bytes"] / (serial / data["ranks"]) if serial else 0)
                elements.append(r.get("elements_measured", r.get("elements_formula")) or 0)
        speed.barh(labels, tokens)
        speed.set_xlabel("tokens/s (fwd+bwd)")
        speed.invert_yaxis()
        memory.barh(labels, acts)
        memory.axvline(1.0, color="k", linestyle=":")
        memory.set_xlabel("saved activations per rank ÷ (serial / p)")
        memory.set_yticks([])
        memory.invert_yaxis()
        comm.barh(labels, elements)
        comm.set_xlabel("elements sent per rank, fwd+bwd (optimus2d: counted; peers: formula)")
        comm.set_yticks([])
        comm.invert_yaxis()
        fig.tight_layout()
        fig.savefig(folder / "speed_memory.png", dpi=90)
        written.append("speed_memory.png")
    same = [v for k, v in sorted(results.items()) if k.split("-p")[0] == "mlp" and "train_ms" in v["rows"][0]]
    if len(same) > 1:  # measured scaling: the same MLP on 1, 4, 8 ranks
        fig, ax = plt.subplots(figsize=(6, 4.5))
        by_peer: dict[str, list[tuple[int, float]]] = {}
        for data in sorted(same, key=lambda d: d["ranks"]):
            for r in data["rows"]:
                peer = r["peer"].replace("2.5D", "2D") if not r["peer"].startswith("torch") else "torch, 1 rank"
                by_peer.setdefault(peer, []).append((data["ranks"], r["tokens_per_s"]))
        for peer, pts in by_peer.items():
            ax.plot(*zip(*pts, strict=True), marker="o", label=peer)
        ax.set_xlabel("ranks (on this machine's cores)")
        ax.set_ylabel("tokens/s, MLP fwd+bwd")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(folder / "scaling.png", dpi=90)
        written.append("scaling.png")
    plan = results.get("plan-p1-q1d1")
    if plan:  # projected step time and isoefficiency against devices
        fig, (times, iso) = plt.subplots(1, 2, figsize=(12, 4.5))
        for scheme in ("1d", "1d-sp", "2d", "2.5d:2", "2.5d:4"):
            pts = [(r["p"], r["time_s"][scheme]) for r in plan["rows"] if scheme in r["time_s"]]
            if pts:
                times.plot(*zip(*pts, strict=True), marker="o", label=scheme)
            pts = [
                (r["p"], r["isoefficiency_hidden"][scheme])
                for r in plan["rows"]
                if r["isoefficiency_hidden"].get(scheme)
            ]
            if pts:
                iso.plot(*zip(*pts, strict=True), marker="o", label=scheme)
        for ax, ylabel in ((times, "predicted layer fwd+bwd (s)"), (iso, "hidden size for 50 % efficiency")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xlabel("devices p")
            ax.set_ylabel(ylabel)
            ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "projection.png", dpi=90)
        written.append("projection.png")
    calib = next((v for k, v in results.items() if k.startswith("calibrate")), None)
    if calib:
        fig, ax = plt.subplots(figsize=(5, 5))
        measured = [r["measured_ms"] for r in calib["rows"]]
        predicted = [r["predicted_ms"] for r in calib["rows"]]
        ax.scatter(measured, predicted)
        for r in calib["rows"]:
            ax.annotate(f"{r['peer']} b{r['batch']}", (r["measured_ms"], r["predicted_ms"]), fontsize=7)
        top = 1.1 * max(measured + predicted)
        ax.plot([0, top], [0, top], "k:")
        ax.fill_between([0, top], [0, 0.75 * top], [0, 1.25 * top], alpha=0.1)
        ax.set_xlabel("measured ms")
        ax.set_ylabel("predicted ms")
        fig.tight_layout()
        fig.savefig(folder / "calibration.png", dpi=90)
        written.append("calibration.png")
    return [f"![{name}]({name})" for name in written]


def _checks_table(name: str, data: dict) -> list[str]:
    lines = [
        f"### {name}: {data['what']}, {data['mesh']}",
        "",
        "| check | fwd+bwd ms | ÷ off | fwd ms | exchanges a step |",
    ]
    lines.append("|---|---|---|---|---|")
    for r in data["rows"]:
        lines.append(
            f"| {r['peer']} | {r['train_ms']:.1f} | {r['ratio']:.3f} | {r['infer_ms']:.1f} | {r['check_exchanges']} |"
        )
    return [*lines, ""]


def run(args: argparse.Namespace, world: optimus2d.World, mesh: optimus2d.Mesh) -> None:
    if world.rank != 0:
        return None
    results = _load(args.results)
    lines = ["# Benchmark report", "", "Generated by `python -m benchmarks report` from the JSON in this folder.", ""]
    for name, data in results.items():
        if name.startswith("checks"):
            lines += _checks_table(name, data)
        elif data.get("rows") and "train_ms" in data["rows"][0]:
            lines += _peer_table(name, data)
        elif name.startswith("calibrate"):
            lines += _calibration_table(data)
        elif name.startswith("ceiling"):
            lines += _ceiling_table(data)
        elif name.startswith("transport"):
            lines += _transport_table(name, data)
        elif name.startswith("breakdown"):
            lines += _breakdown_table(name, data)
        elif name.startswith("waits"):
            lines += _waits_table(name, data)
    lines += ["## Plots", "", *_plots(results, args.results), ""]
    out = args.results / "report.md"
    out.write_text("\n".join(lines))
    print(f"wrote {out} ({len(results)} result files)")
    return None
