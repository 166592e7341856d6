"""The benchmark entry point runs end to end (tiny sizes) and its JSON holds what the report needs.

Timings are never asserted (they are noise on shared cores); counts and bytes are exact and are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_launch import BIN, _clean_env

from benchmarks.calibrate import usable_cores
from optimus2d.cost.planner import Hardware, comm_time, mlp_comm

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.slow


def _bench(tmp_path: Path, n: int, *args: str) -> str:
    cmd = [str(BIN / "mpiexec"), "-n", str(n), sys.executable, "-m", "benchmarks", "--results", str(tmp_path), *args]
    env = {**_clean_env(), "OPTIMUS2D_CACHE": str(tmp_path / "cache")}  # plan="auto"'s calibration, not in ~
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _report(tmp_path: Path) -> str:
    """``python -m benchmarks report`` over the JSON in ``tmp_path``; the report's text."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--results", str(tmp_path), "report"],
        cwd=ROOT,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return (tmp_path / "report.md").read_text()


def test_mlp_and_block_benchmarks_count_what_the_formulas_say_bf16_halves_the_bytes_then_report(tmp_path):
    """The mlp and block benchmarks, the mlp's peers again in bf16 (each checked against bf16 serial:
    half the bytes), and the matmul ceiling, in one report."""
    tiny = ["--hidden", "32", "--ffn", "128", "--batch", "2", "--seq", "8", "--rounds", "1"]
    _bench(tmp_path, 4, "mlp", *tiny)
    _bench(tmp_path, 4, "--name", "mlp-bf16", "mlp", *tiny, "--dtype", "bfloat16")
    _bench(tmp_path, 1, "ceiling", "--size", "64", "--rounds", "1")
    _bench(tmp_path, 4, "block", "--hidden", "32", "--heads", "4", "--batch", "2", "--seq", "8", "--rounds", "1")
    for name in ("mlp-p4-q2d1", "block-p4-q2d1"):
        rows = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
        ours = rows[0]
        assert ours["peer"] == "optimus2d 2D" and ours["elements_measured"] == ours["elements_formula"]
        assert ours["train_ms"] > 0 and ours["largest_batch"] > 0
        assert ours["peak_step_bytes"] is None  # the CUDA allocator's count: on a GPU only
    mlp = {r["peer"]: r for r in json.loads((tmp_path / "mlp-p4-q2d1.json").read_text())["rows"]}
    twin = (
        "optimus2d 2D over gloo" if "optimus2d 2D over gloo" in mlp else "optimus2d 2D over MPI"
    )  # the other transport
    assert set(mlp) == {
        "optimus2d 2D", "optimus2d 2D SUMMA", twin, "DTensor 1D", "DTensor 1D + SP", "optimus2d 1D (plan)",
        "optimus2d auto", "optimus2d auto, measured", "optimus2d auto, whole io", "optimus2d auto, whole io, measured",
        "torch, 1 rank",
    }  # fmt: skip
    for name in ("optimus2d auto, whole io", "optimus2d auto, whole io, measured"):  # taking the input whole, a
        if mlp[name]["layouts"]["inner"] == "1d":  # pick in 1D sends nothing of optimus2d's, only torch's
            assert mlp[name]["elements_measured"] == 0
        else:  # on a mesh: its output all-gathered (the input needs no gradient)
            assert mlp[name]["elements_measured"] >= 2 * 8 * 32 * 3 // 4
    # re-planned for the 2D layout's largest batch within the cap, the planner picks a layout that holds it
    # (its memory model agrees with the bytes measured here)
    assert mlp["optimus2d auto"]["largest_batch"] >= mlp["optimus2d 2D"]["largest_batch"]
    assert {mlp[n]["layouts"]["inner"] for n in ("optimus2d auto", "optimus2d auto, measured")} <= {"2×2×1", "1d"}
    assert (tmp_path / "cache" / "hardware.json").is_file()
    assert mlp["optimus2d 1D (plan)"]["activation_bytes"] == mlp["DTensor 1D"]["activation_bytes"]  # the whole input
    # saved activations per row: serial keeps h + 2·ffn (32 + 256), optimus2d (h + ffn)/4 (it recomputes
    # the GELU), 1D keeps the replicated input whole
    assert mlp["optimus2d 2D"]["activation_bytes"] * 4 * (32 + 256) == mlp["torch, 1 rank"]["activation_bytes"] * 160
    assert mlp["DTensor 1D"]["activation_bytes"] > mlp["optimus2d 2D"]["activation_bytes"]
    fp32, bf16 = (json.loads((tmp_path / f"{n}-p4-q2d1.json").read_text())["rows"] for n in ("mlp", "mlp-bf16"))
    assert [r["peer"] for r in fp32] == [r["peer"] for r in bf16]
    for a, b in zip(fp32, bf16, strict=True):
        if a.get("layouts") != b.get("layouts"):  # a timed pick (auto, measured) may differ between the runs
            continue
        assert b["activation_bytes"] * 2 == a["activation_bytes"] and b["parameter_bytes"] * 2 == a["parameter_bytes"]
    assert bf16[0]["elements_measured"] == fp32[0]["elements_measured"] > 0
    ceiling = json.loads((tmp_path / "ceiling-p1-q1d1.json").read_text())
    assert [r["dtype"] for r in ceiling["rows"]] == ["float32", "bfloat16"] and ceiling["rows"][0]["tflops"] > 0
    report = _report(tmp_path)
    assert "| optimus2d 2D SUMMA |" in report and "### block-p4-q2d1" in report
    assert "### Matmul ceiling: 64×64×64 on CPU, 1 thread" in report


def test_breakdown_times_compute_and_communication_apart(tmp_path):
    _bench(tmp_path, 4, "breakdown", "--hidden", "32", "--ffn", "128", "--batch", "2", "--seq", "8", "--rounds", "1")
    result = json.loads((tmp_path / "breakdown-p4-q2d1.json").read_text())
    ours, one_d = result["rows"]
    assert ours["elements"] == result["elements_formula"] and one_d["elements"] == 2 * 8 * 32  # the 1D all-reduce
    assert len(result["times_ms"]) == 7 and all(t > 0 for t in result["times_ms"].values())
    kernels = result["compute_kernels_ms"]
    assert list(kernels) == ["optimus2d 2D (SUMMA)", "DTensor 1D"] and list(kernels["DTensor 1D"]) == list(
        kernels["optimus2d 2D (SUMMA)"]
    )
    for found in kernels.values():  # the matmuls are the compute; every listed part is a share of the total
        assert 0 < found["matmuls"] <= found["total"] and found["rest"] >= 0
        assert all(ms >= 0 for ms in found.values())
    assert any(kernels[peer]["aten::gelu"] > 0 for peer in kernels)  # the listed kernels ran
    report = _report(tmp_path)
    assert "| optimus2d 2D (SUMMA) |" in report and "| matmuls | " in report


def test_calibrate_prices_sync_stages_by_the_work_before_them_on_shared_cores(tmp_path):
    tiny = ["--hidden", "32", "--ffn", "128", "--batches", "2", "--seq", "8", "--rounds", "1"]
    _bench(tmp_path, 4, "calibrate", *tiny)
    result = json.loads((tmp_path / "calibrate-p4-q2d1.json").read_text())
    hw = result["hardware"]["2"]
    assert (hw["latency_work"] > 0) == (4 > usable_cores())  # 4 ranks of 1 thread: cores shared?
    assert {r["peer"] for r in result["rows"]} >= {"optimus2d 2D", "optimus2d 2D SUMMA", "DTensor 1D"}
    row = next(r for r in result["rows"] if r["peer"] == "optimus2d 2D SUMMA")
    assert row["predicted_ms"] == pytest.approx(row["compute_ms"] + row["comm_ms"]) and row["measured_ms"] > 0
    assert hw["reduce_bandwidth"] > 0  # the mesh's all-reduce of 16 MiB, measured between matmuls
    priced = Hardware(hw["flops"], hw["bandwidth"], hw["latency"], 4, hw["latency_work"],
                      reduce_bandwidth=hw["reduce_bandwidth"])  # fmt: skip
    comm = mlp_comm(2 * 8, 32, 128, "2d", 4, algorithm="summa")
    compute = row["compute_ms"] / 1e3
    assert row["comm_ms"] == pytest.approx(1e3 * comm_time(comm, priced, compute))  # stages after the work
    if hw["latency_work"] > 0 and hw["latency"] > 0:  # ... which is not what one latency a stage gives
        # (a loaded machine can fit a latency of 0: then every stage costs 0 either way)
        assert row["comm_ms"] != pytest.approx(1e3 * comm_time(comm, priced))
    assert "ms of work (× √(work / that))" in _report(tmp_path)


def test_waits_times_every_mpi_wait_of_both_algorithms(tmp_path):
    _bench(tmp_path, 4, "waits", "--hidden", "32", "--ffn", "128", "--batch", "2", "--seq", "8", "--rounds", "2")
    algorithms = json.loads((tmp_path / "waits-p4-q2d1.json").read_text())["algorithms"]
    assert list(algorithms) == ["summa", "stationary"]
    summa, stationary = algorithms["summa"], algorithms["stationary"]
    assert summa["elements"] > stationary["elements"] > 0  # 2 × 8 rows: the stationary form moves less
    assert all(n > 0 for a in algorithms.values() for n in a["waits_per_step"])
    assert any(kind.startswith("broadcast over") for kind in summa["count_by_kind"])
    assert any(kind.startswith("receive over") for kind in stationary["count_by_kind"])  # streamed blocks
    assert not any(kind.startswith("broadcast") for kind in stationary["count_by_kind"])  # no weight moves
    for a in algorithms.values():
        assert a["by_kind_ms"] and all(ms >= 0 for ms in a["by_kind_ms"].values())
        assert sum(a["count_by_kind"].values()) == a["waits_per_step"][a["longest_rank"]]
    assert "### waits-p4-q2d1: where the step waits" in _report(tmp_path)


@pytest.mark.parametrize(
    "command, message",
    [
        ("breakdown", "breakdown compares a 2D mesh with 1D on the same ranks; got Mesh(q=1, depth=1"),
        ("waits", "waits times MPI waits of a 2D step: it needs q > 1 over mpiexec's MPI; got Mesh(q=1, depth=1"),
    ],
)
def test_profiling_subcommands_refuse_a_mesh_without_a_2d_grid(tmp_path, command, message):
    cmd = [str(BIN / "mpiexec"), "-n", "1", sys.executable, "-m", "benchmarks", "--results", str(tmp_path), command]
    out = subprocess.run(cmd, cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert message in out.stderr


def test_transport_benchmark_times_both_transports(tmp_path):
    _bench(tmp_path, 4, "transport", "--rounds", "1", "--steps", "2")
    result = json.loads((tmp_path / "transport-p4-q2d1.json").read_text())
    assert [(r["op"], r["bytes"]) for r in result["rows"][:3]] == [
        ("exchange", 64),
        ("broadcast", 64),
        ("all-reduce", 64),
    ]
    assert len(result["rows"]) == 9 and all("mpi_ms" in r and "gloo_ms" in r for r in result["rows"])
    after_work = result["sync_after_work"]
    assert [r["rows"] for r in after_work] == [32, 128, 512, 2048]
    assert all(r["work_ms"] > 0 for r in after_work)
    report = _report(tmp_path)
    assert "A 64-byte exchange over mpi after more or less work" in report


def test_meshes_benchmark_times_builds_beside_held_groups_and_names_the_yield(tmp_path):
    out = _bench(tmp_path, 4, "meshes", "--held", "0", "3", "--builds", "2")
    result = json.loads((tmp_path / "meshes-p4-q2d1.json").read_text())
    assert [r["held_groups"] for r in result["rows"]] == [0, 3]
    assert all(0 < r["median_build_s"] <= r["slowest_build_s"] for r in result["rows"])
    yielding = "1" if len(os.sched_getaffinity(0)) < 4 else "unset"  # init() sets it where ranks outnumber cores
    assert result["heavy_yield"] == yielding and f"MPIR_CVAR_ENABLE_HEAVY_YIELD={yielding}" in out
    cmd = [str(BIN / "mpiexec"), "-n", "1", sys.executable, "-m", "benchmarks", "--results", str(tmp_path), "meshes"]
    for bad, got in (
        (["--builds", "0"], "--builds 0 and --held 0 100 200"),
        (["--held", "0", "-1"], "--builds 4 and --held 0 -1"),
    ):
        out = subprocess.run([*cmd, *bad], cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "--builds must be at least 1 and --held at least 0" in out.stderr, out.stderr
        assert f"got {got} (on Mesh(q=1, depth=1" in out.stderr, out.stderr


def test_llama_benchmark_checks_dtensor_1d_under_the_model_plan_then_times_it(tmp_path):
    tiny = ["--layers", "1", "--hidden", "32", "--heads", "4", "--vocab", "64", "--batch", "2", "--seq", "8"]
    _bench(tmp_path, 4, "--name", "llama", "gpt", "--model", "llama", *tiny, "--rounds", "1")
    rows = {r["peer"]: r for r in json.loads((tmp_path / "llama-p4-q2d1.json").read_text())["rows"]}
    assert set(rows) == {
        "optimus2d 2D", "optimus2d 2D, plain blocks", "optimus2d auto", "optimus2d auto, measured", "DTensor 1D",
        "torch, 1 rank",
    }  # fmt: skip
    assert rows["optimus2d 2D"]["elements_measured"] > 0 and rows["DTensor 1D"]["train_ms"] > 0
    assert "model" in rows["optimus2d auto"]["layouts"]  # LLaMA's decoder stack: a region the planner lays out


def test_checks_benchmark_counts_the_agreement_exchanges_then_reports(tmp_path):
    tiny = ["--hidden", "32", "--ffn", "64", "--batch", "4", "--seq", "8", "--rounds", "1"]
    _bench(tmp_path, 4, "checks", *tiny)
    rows = {r["peer"]: r for r in json.loads((tmp_path / "checks-p4-q2d1.json").read_text())["rows"]}
    assert [rows[f"check={level}"]["check_exchanges"] for level in ("off", "entry")] == [0, 3]  # scatter, each Linear2D
    assert rows["check=every"]["check_exchanges"] > 1
    assert rows["check=off again"]["check_exchanges"] == 0
    assert rows["check=entry"]["check_bytes"] == 3 * 160  # 4 ranks × 5 int64 over the mesh, each
    _bench(tmp_path, 4, "--name", "checks-llama", "checks", "--model", "llama", "--layers", "2", "--hidden", "32",
           "--heads", "4", "--vocab", "64", "--batch", "4", "--seq", "8", "--rounds", "1")  # fmt: skip
    llama = {r["peer"]: r for r in json.loads((tmp_path / "checks-llama-p4-q2d1.json").read_text())["rows"]}
    # scatter_batch, then every outermost module call: the embedding; per layer the two norms, q, k, v,
    # o, gate, up and down; the final norm and the head (those whose inputs come unchanged from the
    # call before ride beside its collectives, over gloo too: comm/calls.py); cross_entropy's arguments
    assert llama["check=entry"]["check_exchanges"] == 1 + 1 + 9 * 2 + 2 + 1
    assert "| check=entry |" in _report(tmp_path)


def test_long_benchmark_reports_the_pairs_of_each_split(tmp_path):
    out = _bench(tmp_path, 2, "--depth", "2", "long", "--seq", "512", "--cp", "2", "4", "--image", "48", "--skip-train")
    result = json.loads((tmp_path / "long-p2-q1d2.json").read_text())
    rows = result["rows"]
    assert "train" not in result
    assert len(rows) == 3 * 2 * 3  # masks × sizes × splits
    causal = {(r["c"], r["method"]): r for r in rows if r["mask"] == "causal"}
    assert causal[(4, "head_tail")]["imbalance"] == 1.0 and causal[(4, "uniform")]["imbalance"] > 1.7
    assert all(sum(r["pairs"]) == sum(rows[0]["pairs"]) for r in rows if r["mask"] == "causal")
    assert "max / mean" in out


def test_long_benchmark_trains_llama_in_three_layouts_and_finds_the_longest_sequence_under_the_cap(tmp_path):
    tiny = ["--layers", "1", "--hidden", "32", "--heads", "4", "--vocab", "64", "--train-seq", "64", "--rounds", "1"]
    search = ["--memory-cap-mb", "2", "--start-seq", "64", "--max-seq", "512", "--bisect", "1"]
    _bench(tmp_path, 4, "long", "--seq", "256", "--cp", "2", "--image", "16", *tiny, *search)
    train = json.loads((tmp_path / "long-p4-q2d1.json").read_text())["train"]
    rows = {r["layout"]: r for r in train["rows"]}
    assert list(rows) == ["2D (c = 1)", "CP alone", "CP alone, ring", "DTensor 1D + SP"] and train["divisor"] == 8
    assert rows["CP alone"]["mesh"] == "Mesh(1, depth=4)" and rows["2D (c = 1)"]["mesh"] == "Mesh(2, depth=1)"
    cap = 2 * 2**20
    for r in rows.values():  # the same losses (checked in the run), a time, a longest sequence under the cap
        assert r["step_ms"] > 0 and r["longest_seq"] % 8 == 0 and r["longest_seq"] >= 64
        peaks = {int(s): b for s, b in r["peak_bytes"].items()}  # every longer sequence tried went over
        assert peaks[r["longest_seq"]] <= cap and all(b > cap for s, b in peaks.items() if s > r["longest_seq"])
    assert rows["DTensor 1D + SP"]["comm_bytes"] is None and rows["DTensor 1D + SP"]["step_vs_dtensor"] == 1.0
    s, h, b = 64, 32, 4  # CP alone: ids (int64) and the hidden state in, its gradient back; K, V over c = 4
    cp = rows["CP alone"]["comm_bytes"]
    assert cp["all_to_all"] == 8 * s * b // 4 + 2 * 4 * s * h * b // 4
    assert cp["all_gather"] == cp["reduce_scatter"] == 2 * 4 * b * s * h  # one layer, the whole batch per rank
    ring = rows["CP alone, ring"]["comm_bytes"]  # (6c - 4) K or V blocks of b·(s/c)·h, fp32: sent, not gathered
    assert ring["ring"] == (6 * 4 - 4) * 4 * b * (s // 4) * h and "all_gather" not in ring


def test_checkpoint_benchmark_stores_the_serial_bytes_and_times_three_ways(tmp_path):
    tiny = ["--hidden", "32", "--ffn", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--vocab", "64"]
    _bench(tmp_path, 4, "checkpoint", *tiny, "--batch", "2", "--seq", "8", "--rounds", "1")
    result = json.loads((tmp_path / "checkpoint-p4-q2d1.json").read_text())
    assert result["stored_tensor_bytes"] == result["expected_tensor_bytes"]  # each block once, nothing padded
    assert set(result["blocking_s"]) == {"dcp.save(get_state_dict)", "checkpoint.save", "checkpoint.async_save"}
    assert result["async_done_s"] >= result["blocking_s"]["checkpoint.async_save"] > 0


def test_vlm_benchmark_compares_layouts_per_workload_and_the_planners_pick(tmp_path):
    small = ["--enc-hidden", "32", "--enc-layers", "2", "--lm-hidden", "32", "--lm-layers", "2", "--heads", "4"]
    _bench(tmp_path, 4, "vlm", *small, "--seq", "16", "--workloads", "small-frozen", "--rounds", "1")
    result = json.loads((tmp_path / "vlm-p4-q2d1.json").read_text())  # one workload (the pooled test: another)
    assert [v["workload"] for v in result["summary"]] == ["small-frozen"]
    for verdict, rows in zip(result["summary"], result["workloads"].values(), strict=True):
        times = {r["peer"]: r["train_ms"] for r in rows["rows"] if not r["auto"] and not r["apart"]}
        assert len(times) == 9 and sum(r["plan_pick"] for r in rows["rows"]) == 1  # (2 meshes + 1D)² on 4 ranks
        # over MPI, DTensor's collectives (the 1D linears) have a link of their own: torch's groups
        assert ("torch_link" in rows["hardware"]) == (rows["transport"] == "mpi")
        assert all(v > 0 for v in rows["hardware"].get("torch_link", ()))
        layouts = {(str(r["encoder"]), str(r["lm"])) for r in rows["rows"] if not r["auto"] and not r["apart"]}
        assert {("1d", "1d"), ("1d", "[2, 1]"), ("[1, 4]", "1d")} <= layouts  # Megatron's split, checked first
        [apart] = [r for r in rows["rows"] if r["apart"]]  # 2 + 2 ranks (1 + 3: 1×1×3 cannot split 2 a micro-batch)
        assert apart["encoder_ranks"] == 2 and apart["encoder"] == apart["lm"] == [1, 2] and apart["train_ms"] > 0
        assert verdict["apart_speedup"] == min(times.values()) / apart["train_ms"]  # checked against serial first
        pairs = [r["predicted_ms"] for r in rows["rows"] if not r["auto"] and not r["apart"]]
        assert apart["predicted_ms"] > 0 and verdict["apart_predicted_speedup"] == min(pairs) / apart["predicted_ms"]
        assert verdict["pick_over_best"] == times[verdict["pick"]] / min(times.values())
        auto, timed = [r for r in rows["rows"] if r["auto"]]  # plan="auto": each part whole, or its layers each 1D
        for row in (auto, timed):  # predicted, then measured (Auto(measure=))
            for part in ("encoder", "lm"):
                each = {path: layout for path, layout in row["layouts"].items() if path.startswith(f"{part}.layers.")}
                assert (part in row["layouts"]) != bool(each) and set(each.values()) <= {"1d"}, row["layouts"]
            assert set(row["layouts"].values()) <= {"2×2×1", "1×1×4", "1d"} and row["train_ms"] > 0
        assert not auto["measured"] and timed["measured"]
        assert verdict["auto_over_best"] == auto["train_ms"] / min(times.values())
        assert verdict["measured_auto_over_best"] == timed["train_ms"] / min(times.values())
        for row, key in ((auto, "auto_pair_over_best"), (timed, "measured_auto_pair_over_best")):  # the pick as a pair
            if set(row["layouts"]) != {"encoder", "lm"}:  # a part's layers each in 1D: no pair of the table
                assert verdict[key] is None
                continue
            pair = next(r for r in rows["rows"] if not r["auto"] and [r["encoder"], r["lm"]] == [
                layout if (layout := row["layouts"][part]) == "1d" else [int(n) for n in layout.split("×")[1:]]
                for part in ("encoder", "lm")])  # fmt: skip
            assert verdict[key] == pair["train_ms"] / min(times.values())
        assert verdict["speedup"] == times[verdict["homogeneous"]] / times[verdict["heterogeneous"]]
        placed = {r["peer"]: r for r in rows["rows"] if not r["auto"]}  # propose_placement: the pairs and the split
        [pick] = [r for r in placed.values() if r["placement_pick"]]
        fastest = min(r["train_ms"] for r in placed.values())
        assert verdict["placement"] == pick["peer"] and verdict["placement_over_best"] == pick["train_ms"] / fastest
        assert pick["predicted_ms"] == min(r["predicted_ms"] for r in placed.values() if r["fits_cap"])
        assert pick["apart"] or pick["plan_pick"]  # together, it is propose_layouts' pick


def test_vlm_benchmarks_pooled_workload_judges_the_layouts_that_fit_the_cap(tmp_path):
    """The pooled preset: the LM sees a quarter of the encoder's tokens (priced so, by propose_layouts
    and plan="auto"'s example); a verdict among the pairs whose measured bytes a rank fit the cap."""
    small = ["--enc-hidden", "32", "--enc-layers", "2", "--lm-hidden", "64", "--lm-layers", "1", "--heads", "4"]
    _bench(tmp_path, 4, "vlm", *small, "--seq", "16", "--workloads", "pooled-frozen", "--rounds", "1",
           "--cap-mib", "0.6")  # fmt: skip
    result = json.loads((tmp_path / "vlm-p4-q2d1.json").read_text())
    [verdict], rows = result["summary"], result["workloads"]["pooled-frozen"]["rows"]
    assert result["workloads"]["pooled-frozen"]["config"]["pool"] == 4
    pairs = [r for r in rows if not r["auto"] and not r["apart"]]
    cap = 0.6 * 2**20
    assert all(r["fits_measured"] == (r["memory_bytes"] <= cap) for r in rows)
    everywhere = next(r for r in pairs if r["encoder"] == r["lm"] == [1, 4])  # every weight whole on every rank

    def layer(d: int, f: int) -> int:  # torch's layer: attention (qkv, out), two linears, two norms
        return 4 * d * d + 2 * d * f + 3 * d + d + f + d + 4 * d

    trained, frozen = layer(64, 256) + 32 * 64 + 64, 2 * layer(32, 128)  # the LM and the projector; the encoder
    assert everywhere["memory_bytes"] == 16 * trained + 4 * frozen + everywhere["activation_bytes"]
    within = verdict["within_cap"]
    assert within["left_out"] == [r["peer"] for r in pairs if not r["fits_measured"]] and within["left_out"]
    fit = {r["peer"]: r["train_ms"] for r in pairs if r["fits_measured"]}
    homo = min(t for name, t in fit.items() if name.count("1×1×4") == 2 or name.count("2×2") == 2
               or name.count("1D") == 2)  # fmt: skip
    assert within["homogeneous_ms"] == homo and within["speedup"] == homo / within["heterogeneous_ms"]
    assert within["pick_over_best"] == next(r for r in pairs if r["plan_pick"])["train_ms"] / min(fit.values())


def test_families_sweep_finds_converted_families_exact(tmp_path):
    """The sweep end to end: gpt2 and llama exact (``tests/test_sweep_grads_mpi.py`` proves the
    gradients it reads are the gradients)."""
    out = tmp_path / "sweep.json"
    cmd = [str(BIN / "mpiexec"), "-n", "4", sys.executable, "benchmarks/families_sweep.py"]
    cmd += ["--only", "gpt2", "llama", "--out", str(out)]
    ran = subprocess.run(cmd, cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    families = json.loads(out.read_text())["families"]
    assert [(r["family"], r["category"]) for r in families] == [("gpt2", "exact"), ("llama", "exact")]
