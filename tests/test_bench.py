"""The paper-finding benchmarks in --quick mode: they run end to end, and each cell of their tables is
the number its run logged."""

import hashlib
import json
import os
import shutil
import statistics
import time

import pytest
from scripts import read_metrics, run_script


def final_evaluation(run_dir) -> dict:
    return [m for m in read_metrics(run_dir) if "eval/gold_win_rate" in m][-1]


def assert_plot(path, width: int | None = None, height: int | None = None):
    """`path` is a PNG of `width` x `height` pixels (its figure's size in inches at 100 dpi), not of one color."""
    import matplotlib.image

    image = matplotlib.image.imread(path)  # (height, width, 4)
    assert image.std() > 0.01, path
    assert (width or image.shape[1], height or image.shape[0]) == (image.shape[1], image.shape[0]), image.shape


def bench_module(name: str):
    """A bench script imported as a module, for its pure functions."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).parent.parent / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.heavy
def test_off_policy_quick(tmp_path):
    result = run_script("--quick", "--output_dir", tmp_path, script="bench/off_policy.py")
    results = json.loads((tmp_path / "results.json").read_text())
    table = results["table"]["small"]
    assert sorted(table) == ["bok", "grpo_dapo", "grpo_dr_grpo", "online_dpo", "ppo", "ppo_pure_is", "rloo",
                             "rloo_pure_is"]
    for arm, row in table.items():
        runs = {n: read_metrics(tmp_path / f"small-{arm}-mb{n}-seed1") for n in ("1", "2")}
        for n, metrics in runs.items():
            evaluations = {m["episode"]: m for m in metrics if "eval/gold_win_rate" in m}
            assert sorted(evaluations) == [0, 16, 32], (arm, n)  # 4 steps of 8 prompts: start, half-way, end
            assert row["half_win_rate"][n] == [evaluations[16]["eval/gold_win_rate"], 0.0], (arm, row)
            assert row["win_rate"][n] == [evaluations[32]["eval/gold_win_rate"], 0.0], (arm, row)
            assert row["kl"][n] == [evaluations[32]["eval/kl"], 0.0], (arm, row)
        assert row["drop"] == [row["win_rate"]["1"][0] - row["win_rate"]["2"][0], 0.0]  # one seed
        updates = [m for m in runs["2"] if "loss/policy_avg" in m]
        assert len(updates) == 2  # N = 2: two generations, each trained on in two steps
        if arm.endswith("pure_is"):  # its ratio is 1 at every step
            assert all(abs(m["val/ratio"] - 1) < 1e-5 for m in updates), arm
    assert "drop N=1->2" in result.stdout
    assert_plot(tmp_path / "results.png", 2000, 420)  # one size: a row of panels 20 x 4.2 inches


@pytest.mark.slow
@pytest.mark.heavy
def test_sync_vs_async_quick(tmp_path):
    started = time.time()
    result = run_script("--quick", "--output_dir", tmp_path, script="bench/sync_vs_async.py")
    table = json.loads((tmp_path / "results.json").read_text())["table"]
    assert sorted(table) == ["async", "sync HF"]
    for arm, row in table.items():
        metrics = read_metrics(tmp_path / f"{arm.replace(' ', '-')}-seed1")
        final = final_evaluation(tmp_path / f"{arm.replace(' ', '-')}-seed1")
        assert row["final_win_rates"] == [final["eval/gold_win_rate"]], (arm, row)
        # from its launch (after this test started, before the run's first line) to its final evaluation
        assert final["time"] - metrics[0]["time"] <= 60 * row["total_minutes"] <= final["time"] - started, arm
    assert_plot(tmp_path / "win_rate_vs_time.png", 800, 500)
    assert "async vs sync HF: total time" in result.stdout


@pytest.mark.slow
@pytest.mark.heavy
def test_math_sync_vs_async_quick(tmp_path):
    """Also the learning test of online DPO, sync and async, on the arithmetic task."""
    result = run_script("--quick", "--output_dir", tmp_path, script="bench/math_sync_vs_async.py")
    table = json.loads((tmp_path / "results.json").read_text())["table"]
    assert sorted(table) == ["online_dpo async", "online_dpo sync"]
    for run, row in table.items():
        evals = [m["eval/accuracy"] for m in read_metrics(tmp_path / f"{run.replace(' ', '-')}-seed1")
                 if "eval/accuracy" in m]
        assert row["final_accuracies"] == [evals[-1]] and row["start_accuracy"] == evals[0], (run, row)
        assert evals[0] < 0.5 and evals[-1] >= 0.8, (run, evals)  # both scripts learn: measured 0.41 -> 1.0
    assert_plot(tmp_path / "accuracy_vs_time.png", 600, 450)  # one algorithm's panel
    assert "online_dpo async vs sync: total time" in result.stdout


@pytest.mark.slow
@pytest.mark.heavy
def test_multiturn_sync_vs_async_quick(tmp_path):
    """Both multi-turn scripts on guess-the-number with steps 0.1 s slower, 6 updates: each row is its runs'
    numbers, each step took the latency, and the curves are kept."""
    result = run_script("--quick", "--output_dir", tmp_path, script="bench/multiturn_sync_vs_async.py")
    table = json.loads((tmp_path / "results.json").read_text())["table"]["0.1"]
    assert sorted(table) == ["async", "bound", "sync"] and table["bound"] >= 1
    for arm in ("sync", "async"):
        row = table[arm]
        metrics = read_metrics(tmp_path / f"{arm}-latency0.1-seed1")
        evals = [m["eval/return_mean"] for m in metrics if "eval/return_mean" in m]
        assert row["final_returns"] == [evals[-1]] and len(evals) == 3, (arm, row)
        updates = [m for m in metrics if "loss/policy_avg" in m]
        assert len(updates) == 6 and row["phases"]["time/train"] == statistics.median(
            m["time/train"] for m in updates), (arm, row)
        assert all(m["env/step_time_median"] >= 0.1 for m in updates)
        if arm == "async":  # every arm evaluates in the trainer, as sync does
            run_args = json.loads((tmp_path / "async-latency0.1-seed1" / "args.json").read_text())["args"]
            assert run_args["eval_in_trainer"]
        assert row["curves"][0]["rollout/return_mean"] == [m["rollout/return_mean"] for m in updates]
    assert "async vs sync, wall minutes to return 0.6" in result.stdout
    assert "async vs sync, training minutes of the 6 updates" in result.stdout


@pytest.mark.slow
@pytest.mark.heavy
def test_off_policy_corrections_quick(tmp_path):
    """GRPO on the arithmetic task at K = 2 without a correction and with m2po, 4 updates: each cell is its run's
    numbers."""
    result = run_script("--quick", "--output_dir", tmp_path, script="bench/off_policy_corrections.py")
    results = json.loads((tmp_path / "results.json").read_text())
    table = results["table"]["grpo math"]
    assert list(table) == ["2"] and list(table["2"]) == ["none", "m2po"]
    for correction, cell in table["2"].items():
        metrics = read_metrics(tmp_path / f"grpo-math-k2-{correction}-seed1")
        evaluations = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
        train = [m for m in metrics if "async/mismatch_kl" in m]
        assert [m["async/staleness"] for m in train] == [0, 1, 2, 2]
        assert cell["score"] == [evaluations[-1], 0.0] and cell["early_score"] == [evaluations[0], 0.0]
        assert cell["mismatch_kl"][0] == pytest.approx(sum(m["async/mismatch_kl"] for m in train) / 4), correction
        assert cell["mismatch_kl"][0] > 0
        assert cell["ess"][0] == pytest.approx(sum(m["async/ess"] for m in train) / 4) and cell["ess"][0] < 1
        assert cell["dropped_frac"][0] == pytest.approx(sum(m.get("async/m2po_masked_frac", 0) for m in train) / 4)
        # every update's numbers, kept: the curves a reader can re-draw
        curves = results["curves"][f"grpo math k2 {correction} seed1"]
        assert curves["update"] == [1, 2, 3, 4] and curves["eval_update"] == [m["update"] for m in metrics
                                                                               if "eval/accuracy" in m]
        assert curves["async/mismatch_kl"] == pytest.approx([m["async/mismatch_kl"] for m in train], abs=1e-6)
        assert curves["eval/accuracy"] == pytest.approx(evaluations, abs=1e-6)
    assert_plot(tmp_path / "results.png", 500)  # one column of panels, 5 inches wide
    assert_plot(tmp_path / "results_curves.png", 400)
    assert "grpo math: score a quarter of the way" in result.stdout


@pytest.mark.slow
@pytest.mark.heavy
def test_which_tokens_move_reads_a_runs_snapshots(tmp_path):
    """A K = 2 GRPO run on the arithmetic task with a snapshot every 2 updates: the mismatch of each snapshot on the
    starting policy's completions, split by kind and position into shares that add up to 1, each kind's tokens
    counted once."""
    run_script("--preset", "toy-math", "--async_steps", "2", "--total_episodes", "256", "--save_every", "2",
               "--eval_every", "0", "--output_dir", tmp_path / "run", script="grpo_vllm.py")
    result = run_script("--run_dir", tmp_path / "run", "--updates", "2", "4", "--prompts", "32", "--output_dir",
                        tmp_path, script="bench/which_tokens_move.py")
    measured = json.loads((tmp_path / "which_tokens_move_run.json").read_text())
    assert sorted(measured["by_update"], key=int) == ["2", "4"]
    for entry in measured["by_update"].values():
        assert entry["mismatch_kl_per_token"] > 0
        assert sum(kind["share_of_mismatch"] for kind in entry["by_kind"].values()) == pytest.approx(1.0)
        assert sum(entry["by_position"].values()) == pytest.approx(1.0)
        assert 0 < entry["largest_token_share_median"] <= 1
    tokens = sum(kind["tokens"] for kind in measured["by_update"]["2"]["by_kind"].values())
    assert f"{tokens} tokens" in result.stdout


def test_the_horizon_table_is_drawn_from_the_stored_curves(tmp_path):
    """bench/horizon_table.py: each cell from the results JSON's per-update curves (two seeds pooled: mean ± std;
    seed 2 back at 0.95 from update 108, seed 1 never), the rows of a file with a flag of its own named by it, a run
    two files hold counted once, a run on another build of the task (its file's world) a row of its own, a run on the
    stored build (horizon_table.STORED_BUILD) the stored runs' row."""
    def curve(scale: float) -> dict:
        return {"update": list(range(1, 129)), "async/mismatch_kl": [scale * u for u in range(1, 129)],
                "async/ess": [1.0 - scale] * 128, "eval_update": list(range(0, 129, 4)),
                "eval/accuracy": [0.5 if u == 20 else scale * 100 + (0.1 * (u >= 108)) for u in range(0, 129, 4)],
                "eval/kl": [0.0] * 32 + [scale]}
    files = []
    for name, extra, curves in [("a", "--total_episodes 8192", {"ppo math k16 none seed1": curve(0.008),
                                                                 "ppo math k16 none seed2": curve(0.009)}),
                                ("b", "--total_episodes 8192 --kl_penalty_logprobs start",
                                 {"ppo math k16 none seed1": curve(0.007)}),
                                ("c", "--total_episodes 8192", {"ppo math k4 none seed1": curve(0.001)}),
                                ("d", "--total_episodes 8192", {"ppo math k16 none seed2": curve(0.009)}),
                                ("e", "--total_episodes 8192", {"ppo math k16 none seed1": curve(0.005)}),
                                ("f", "--total_episodes 8192", {"ppo math k16 none seed2": curve(0.009)})]:
        # e: the same run on another build of the task, which its file records: a row of its own; f: a file that
        # records the stored build, whose runs are the first files' (which record none)
        world = {"e": {"world": {"policy_sha256": "abcdef12" + "0" * 56}},
                 "f": {"world": {"policy_sha256": "bef384c7" + "0" * 56}}}.get(name, {})
        (tmp_path / f"{name}.json").write_text(json.dumps({"args": {"extra": extra}, "curves": curves, **world}))
        files.append(tmp_path / f"{name}.json")
    table = run_script(*files, script="bench/horizon_table.py").stdout.splitlines()
    assert table[3] == ("| ppo k16 none | 1,2 | 0.850 ± 0.071 | 0.850 ± 0.071 | 0.850 ± 0.071 | 0.850 ± 0.071 | "
                        "0.850 ± 0.071 | 0.950 ± 0.071 | 0.50 (20), 0.50 (20) | -, 108 | "
                        "0.076 ± 0.006 / 0.212 ± 0.018 / 0.412 ± 0.034 / 0.820 ± 0.068 | 0.99 ± 0.00 / 0.99 ± 0.00 | "
                        "0.01 ± 0.00 |")
    assert table[4].startswith("| ppo k16 none --kl_penalty_logprobs start | 1 | 0.700 |")
    assert table[5].startswith("| ppo k16 none [toy abcdef12] | 1 | 0.500 |")
    # K = 4: the windows 1-5 (the starting policy's samples), 6-32, 33-64, 65-128
    assert table[2].endswith("| 0.10 (12) | - | 0.003 / 0.019 / 0.049 / 0.097 | 1.00 / 1.00 | 0.00 |"), table[2]
    assert len(table) == 6


def test_the_latency_table_is_drawn_from_the_sweeps_results(tmp_path):
    """bench/latency_table.py: medians over the seeds, a target some seed never reached shown as "-", the ratios to
    sync on the training clock and to --target on the wall clock (per seed: their median and range)."""
    def row(minutes_total: list[float], to_half: list[float | None], generate: float | None = None) -> dict:
        return {"final_returns": [0.5, 0.75, 1.0], "training_minutes_total": minutes_total,
                "wall_minutes_to_0.5": to_half, "wall_minutes_to_0.8": [1.0, None, 2.0],
                "phases": {} if generate is None else {"time/generate": generate}}
    results = {"args": {"targets": [0.5, 0.8], "updates": 30},
               "table": {"0.5": {"sync": row([1.0, 2.0, 3.0], [0.3, 0.6, 0.9]),
                                 "async": row([0.5, 1.0, 4.0], [0.2, 0.3, 0.4], generate=1.5), "bound": 1.25}}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    table = run_script(tmp_path / "results.json", "--target", "0.5", script="bench/latency_table.py").stdout
    assert table.splitlines()[2:] == [
        "| 0.5 s | sync | 0.750 (0.50, 0.75, 1.00) | 4.00 | - | 0.60 / - | 1.00x | 1.00x (1.00-1.00x) |",
        # per seed 0.3 / 0.2, 0.6 / 0.3, 0.9 / 0.4
        "| 0.5 s | async | 0.750 (0.50, 0.75, 1.00) | 2.00 | 1.50 | 0.30 / - | 2.00x | 2.00x (1.50-2.25x) |",
        "| 0.5 s | bound (G + T) / max(G, T), sync's parts | | | | | 1.25x | |"]
    refused = run_script(tmp_path / "results.json", "--target", "0.7", script="bench/latency_table.py", check=False)
    assert refused.returncode != 0 and "--target 0.7 is not one of the sweep's targets [0.5, 0.8]" in refused.stderr


def test_the_latency_sweeps_vllm_arms_evaluate_in_the_trainer_unless_told():
    """Every arm evaluates in the trainer by default (the same work on every clock); --engine_evaluation leaves the
    vLLM arms their scripts' default, evaluation in the engine."""
    bench = bench_module("multiturn_sync_vs_async")
    default, in_engine = bench.Args(), bench.Args(engine_evaluation=True)
    assert [("--eval_in_trainer" in bench.run_command(arm, 0.5, 1, default, "out")) for arm in bench.ARMS] == [
        False, True, True, True]  # sync, async, continuous, inflight: grpo_multiturn.py evaluates nowhere else
    assert not any("--eval_in_trainer" in bench.run_command(arm, 0.5, 1, in_engine, "out") for arm in bench.ARMS)


def test_a_sweeps_result_files_name_what_it_left_out_or_added():
    """Two sweeps that differ in K (or anything else) never write the same file in bench/results."""
    bench = bench_module("off_policy_corrections")
    assert bench.result_name(bench.Args()) == "off_policy_corrections"
    assert bench.result_name(bench.Args(algorithms=("grpo",), async_steps=(4,), extra="--total_episodes 8192")) == (
        "off_policy_corrections_grpo_k4_total_episodes-8192")
    assert bench.result_name(bench.Args(tasks=("tldr",), async_steps=(4, 16), corrections=("none", "m2po"))) == (
        "off_policy_corrections_tldr_none_m2po_k4-16")
    assert bench.result_name(bench.Args(async_steps=(16, 4, 1, 0))) == "off_policy_corrections"
    # a third seed run later goes beside the first two's file, not over it
    assert bench.result_name(bench.Args(seeds=(1, 2, 3))) == "off_policy_corrections"
    assert bench.result_name(bench.Args(algorithms=("grpo",), async_steps=(0,), corrections=("none",), seeds=(3,),
                                        extra="--eval_in_trainer")) == (
        "off_policy_corrections_grpo_none_k0_eval_in_trainer_seeds-3")
    # snapshots for bench/dip_diagnostics.py change neither the runs' numbers nor the names
    snapshots = bench.Args(algorithms=("grpo",), save_every=4)
    assert bench.result_name(snapshots) == bench.result_name(bench.Args(algorithms=("grpo",)))
    command = bench.run_command("grpo", "math", 16, "none", 1, snapshots, "out")
    assert " ".join(command[2:]).endswith("--seed 1 --output_dir out --save_every 4")


def test_every_computed_passage_of_results_is_what_the_stored_data_give(tmp_path):
    """bench/RESULTS.md's computed passages are bench/findings.py's rendering of bench/results: as committed they
    match; a number edited by hand in RESULTS.md, or one accuracy changed in the stored curves, makes --check fail
    and name the passages."""
    import pathlib
    import shutil

    bench = pathlib.Path(__file__).parent.parent / "bench"
    assert "every computed passage" in run_script("--check", script="bench/findings.py").stdout
    edited = tmp_path / "RESULTS.md"
    text = (bench / "RESULTS.md").read_text()
    passage = text.index("<!-- computed: horizon_findings -->")
    first_number = passage + text[passage:].index("0.9")  # the first accuracy in that passage
    edited.write_text(text[:first_number] + "0.8" + text[first_number + 3:])
    refused = run_script("--check", "--results_md", edited, script="bench/findings.py", check=False)
    assert refused.returncode != 0 and "horizon_findings" in refused.stderr and "latency" not in refused.stderr
    results = tmp_path / "results"
    shutil.copytree(bench / "results", results)
    path = results / "off_policy_corrections_grpo_k16_total_episodes-8192_eval_in_trainer.json"
    stored = json.loads(path.read_text())
    stored["curves"]["grpo math k16 none seed2"]["eval/accuracy"][5] -= 0.25  # (seed 1 is made again elsewhere)
    path.write_text(json.dumps(stored))
    refused = run_script("--check", "--results_dir", results, script="bench/findings.py", check=False)
    assert refused.returncode != 0 and "horizon_table" in refused.stderr and "horizon_findings" in refused.stderr


def test_a_stored_run_made_again_is_checked_against_its_curves(tmp_path):
    """findings.reproduced: a run that a file without a build and a file of the stored build both hold gives the
    largest difference of its logged numbers and whether its evaluations are the same; another build's file, or a
    run only one file holds, is not compared."""
    findings = bench_module("findings")

    def write(name: str, sha: str | None, curves: dict) -> str:
        world = {"world": {"policy_sha256": sha + "0" * 56}} if sha else {}
        (tmp_path / name).write_text(json.dumps({"args": {"extra": "--total_episodes 8192"}, "curves": curves,
                                                 **world}))
        return str(tmp_path / name)

    def curve(kl: list[float], accuracy: list[float]) -> dict:
        return {"update": [1, 2], "async/mismatch_kl": kl, "async/ess": [None, 0.9], "eval_update": [0, 4],
                "eval/accuracy": accuracy}

    paths = [write("stored.json", None, {"grpo math k16 none seed1": curve([0.1, 0.2], [0.5, 0.75]),
                                         "grpo math k16 none seed2": curve([0.1, 0.2], [0.5, 0.75])}),
             write("again.json", "bef384c7", {"grpo math k16 none seed1": curve([0.1000003, 0.2], [0.5, 0.75]),
                                              "grpo math k16 tis seed1": curve([0.1, 0.2], [0.5, 0.5])}),
             write("other.json", "9798ed0e", {"grpo math k16 none seed2": curve([0.3, 0.2], [0.5, 0.5])})]
    run = "grpo math k16 none seed1 --total_episodes 8192"
    table = bench_module("horizon_table")
    assert findings.reproduced(table.load(paths)) == {run: (pytest.approx(3e-7), True)}
    write("again.json", "bef384c7", {"grpo math k16 none seed1": curve([0.1, 0.2], [0.5, 0.5])})
    assert findings.reproduced(table.load(paths)) == {run: (0.25, False)}  # an evaluation 0.75 there, 0.5 here
    assert table.build_label({"policy_sha256": "bef384c7" + "0" * 56}) == table.build_label(None) == ""
    assert table.build_label({"policy_sha256": "9798ed0e" + "0" * 56}) == "[toy 9798ed0e]"


def test_the_findings_statistics_on_hand_computed_numbers():
    """A paired difference is its mean and range over the seeds, "no evidence" where the range straddles 0; a run's
    fall is its largest drop from an earlier evaluation; the time-averaged return is the area under the curve."""
    findings = bench_module("findings")
    assert findings.difference({1: -0.02, 2: -0.04}) == "-0.030 (per seed -0.040 to -0.020, 2 seeds)"
    assert findings.difference({1: -0.02, 2: 0.01}) == (
        "no evidence of a difference (per seed -0.020 to +0.010, 2 seeds)")
    curve = {"eval_update": [0, 4, 8, 12, 16, 20], "eval/accuracy": [0.3, 0.96, 0.9, 0.5, 0.97, 0.8]}
    assert findings.fall(curve) == (pytest.approx(0.46), 12)  # 0.96 to 0.5; 0.97 at 16 to 0.8 is smaller
    assert findings.onset(curve) == 8 and findings.mean_accuracy(curve) == pytest.approx(4.13 / 5)
    assert findings.lowest(curve) == (0.5, 12) and findings.back_at(curve) == 16
    # returns 0 -> 1 over the first minute, then 1: over 2 minutes 0.75, over half a minute 0.25
    evals = [{"wall_minutes": 0.0, "return": 0.0}, {"wall_minutes": 1.0, "return": 1.0},
             {"wall_minutes": 3.0, "return": 1.0}]
    assert findings.time_averaged_return(evals, 2.0) == pytest.approx(0.75)
    assert findings.time_averaged_return(evals, 0.5) == pytest.approx(0.25)
    # a horizon run's folder, as the bench names it (dip_diagnostics.json's key)
    assert findings.run_name(("grpo", 16, "decoupled", "--lr_scheduler_type constant"), 2) == (
        "grpo-math-k16-decoupled_total_episodes-8192_eval_in_trainer_lr_scheduler_type-constant-seed2")


def test_the_speed_benchmarks_comparisons_are_paired_per_round_on_hand_made_runs():
    """The speed sections' ratios pair each round (or seed) of one arm with the same round of the other: TRL over the
    kit, sync's training minutes over an engine arm's, K=0 over K=1, K=1 over in flight; each the median of the
    pairs with their range, "no evidence" where the range reaches the other side of no difference."""
    findings = bench_module("findings")

    def trl_run(seconds: float) -> dict:
        return {"seconds_per_step": seconds}

    trl = {"args": {"repeats": 3, "steps": 30, "warmup": 3, "prompts_per_step": 8, "response_length": 32},
           "runs": {"kit": [trl_run(1.0), trl_run(2.0), trl_run(1.0)],
                    "TRL tuned": [trl_run(1.5), trl_run(1.0), trl_run(1.2)],  # 1.5, 0.5, 1.2: the median 1.2
                    "TRL default": [trl_run(2.0), trl_run(5.0), trl_run(3.0)]},  # 2, 2.5, 3: the kit faster
           "table": {"kit": {"completions": 16, "stopped": 16}, "TRL tuned": {}}}
    text = " ".join(findings.trl_findings(trl).split())
    assert "TRL tuned **1.20x** [" in text and "(no evidence of a difference; per round 0.50 to 1.50, the kit faster " \
        "in 2 of 3)" in text
    assert "TRL defaults **2.50x** [2.00, 3.00] (the kit faster; per round 2.00 to 3.00, the kit faster in 3 of 3)" \
        in text
    arm = {"final_returns": [0.8, 0.7], "training_minutes_to_target": [0.1, 0.4],
           "training_minutes_total": [0.5, 0.4], "total_minutes": [1.0, 1.0]}
    multiturn = {"args": {"seeds": [1, 2], "updates": 40, "target_return": 0.6},
                 "table": {"sync": {"final_returns": [0.7, 0.8], "training_minutes_to_target": [0.2, 0.2],
                                    "training_minutes_total": [1.0, 1.0], "total_minutes": [1.2, 0.8]},
                           "async": arm}}
    text = " ".join(findings.multiturn_findings(multiturn).split())
    assert "async (K=1): 2.25x (2.00 to 2.50) for the 40 updates, 1.25x (0.50 to 2.00; no evidence of a difference) " \
        "to 0.6, 1.00x (0.80 to 1.20; no evidence of a difference) for the whole run since launch; its final return " \
        "minus sync's +0.000 (-0.100 to +0.100; no evidence of a difference)" in text

    def setting(seconds: list[float], **parts) -> dict:
        return {"runs": [{"seconds_per_update": s, "end_to_end": 10 * s, "gold_win_rate": 0.5} for s in seconds],
                "wait": 0.01, **parts}

    speed = {"settings": {"hf": setting([1.0, 1.2]), "k1": setting([0.5, 0.8]), "k0": setting([1.0, 1.2])}}
    text = " ".join(findings.async_speedup_findings([("toy", speed)]).split())
    assert "toy: K=1 over K=0 1.75x (1.50 to 2.00), over sync HF 1.75x (1.50 to 2.00) per update" in text
    assert findings.overlap_bound({"generate": 0.3, "weight_sync": 0.05, "logprob_check": 0.05, "score": 0.2,
                                   "train": 0.6}) == (pytest.approx(0.4), pytest.approx(0.8), pytest.approx(1.5))
    inflight = {"settings": {"k1": setting([1.0, 1.0, 1.0]), "inflight": setting([0.5, 1.0, 2.0])}}
    inflight["settings"]["inflight"]["runs"][0]["gold_win_rate"] = 0.6
    text = " ".join(findings.inflight_findings(inflight).split())
    assert "1.00x (0.50 to 2.00) per update" in text and "minus K=1's +0.000 (+0.000 to +0.100)" in text


def test_the_stored_benchmarks_tables_render_their_numbers(tmp_path):
    """The default runs' table (score at the start, update 10 and the end; a run without update 10 or KL shows
    "-"), the template outcomes' counts, CI's slow tier from its log's tail, LoRA's and generation speed's paired
    ratios (median of the rounds' ratios, not a ratio of medians)."""
    findings = bench_module("findings")
    world = {"policy_sha256": "ab" * 32, "cpu": "a CPU", "avx512": True}
    runs = {"date": "2026-12-07", "machine": {"cpu": "a CPU", "boot_id": "b"}, "runs": {
        "online_dpo": {"command": ["python", "online_dpo.py"], "seconds": 61.4, "score": "gold_win_rate",
                       "updates": [0, 10, 70], "scores": [0.0, 0.5, 0.6], "kl": [0.0, 0.2, 1.1], "world": world},
        "grpo_multiturn": {"command": ["python", "grpo_multiturn.py"], "seconds": 30.0, "score": "return_mean",
                           "updates": [0, 5, 40], "scores": [0.25, 0.5, 0.75], "kl": [None, None, None],
                           "world": world}}}
    table = findings.default_runs_table(runs)
    assert "| `python online_dpo.py` | 61 | gold win-rate | 0.000 | 0.500 | 0.600 (70) | 1.10 |" in table
    assert "| `python grpo_multiturn.py` | 30 | return | 0.250 | - | 0.750 (40) | - |" in table
    assert "by the task's score: gold win-rate/return abababab." in " ".join(table.split())
    outcomes = {"date": "d", "versions": {"chatlint": "1", "transformers": "2"}, "outcomes": {
        "a": "plays (hermes)", "b": "plays (hermes)", "c": "refused: x", "d": "plays (mistral)"}}
    text = " ".join(findings.tool_templates_table(outcomes).split())
    assert "4 chat templates tried" in text and "3 play their episode, 1 are refused at load on one line, 0 do" in text
    assert text.index("plays (hermes) | 2") < text.index("plays (mistral) | 1") < text.index("refused: x | 1")
    (tmp_path / "ci_slow_tier.txt").write_text(
        "# the whole run: exit 0 after 1200 s\n120.00s setup    tests/test_a.py::t1\n"
        "60.00s call     tests/test_b.py::t2\n30.00s call     tests/test_a.py::t3\n"
        "== 3 passed in 600.00s (0:10:00) ==\n\nreal\t10m0.0s\nuser\t15m0.0s\nsys\t3m0.0s\n")
    text = " ".join(findings.ci_slow_tier(str(tmp_path)).split())
    assert "20.0 minutes in all" in text and "3 passed in 10.0 minutes (18.0 minutes of CPU over 10.0" in text
    assert "1.80 cores busy" in text and "took 3.5 minutes, by file (minutes): `test_a.py` 2.5, `test_b.py` 1.0" in text

    def lora_run(seconds: float, peak: float) -> dict:
        return {"seconds_per_update": seconds, "train": seconds / 2, "peak_gib": peak, "trainable_share": 1.0}

    lora = {"date": "d", "cpu": "c", "args": {"script": "online_dpo.py", "prompts_per_update": 8, "extra": "",
                                             "updates": 4, "repeats": 2},
            "settings": {"full": {**lora_run(10, 4), "runs": [lora_run(10, 4), lora_run(12, 4)]},
                         "LoRA": {**lora_run(10, 3), "runs": [lora_run(10, 3), lora_run(8, 2)]}}}
    text = " ".join(findings.lora_table(lora).split())
    assert "peak memory 0.62x (0.50 to 0.75) of full's; full's seconds per update over LoRA's 1.25x (1.00 to 1.50)" \
        in text
    speeds = {"date": "d", "machine": {"cpu": "c", "boot_id": "b"}, "args": {"rows": 8, "new_tokens": 4, "threads": 1,
                                                                           "repeats": 3},
              "sizes": {"512": {"parameters": 2.5e6, "hf_seconds": [2.0, 3.0, 4.0], "vllm_seconds": [1.0, 1.0, 4.0]}}}
    text = findings.generation_speed_table(speeds)
    assert "| 512 | 2.5M | 3.00 | 1.00 | 2.00x (1.00 to 3.00) |" in text
    assert "less time than HF's in 2 of 3 rounds at hidden size 512." in text


@pytest.mark.slow  # on the arithmetic task, which only the slow tier builds
def test_dip_diagnostics_reads_a_runs_snapshots(tmp_path):
    """bench/dip_diagnostics.py on a run whose snapshot at update 4 is the starting policy itself: the classes hold
    every problem, update 4 measures as update 0, each class's decision probability is the mean of a direct forward's
    next-token probability, and its accuracy that of greedy completions (near-greedy may differ on a tie)."""
    import os
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import toy

    policy_path, dataset = os.path.join(toy.MATH_DIR, "sft_policy"), os.path.join(toy.MATH_DIR, "dataset")
    run = tmp_path / "run"
    shutil.copytree(policy_path, run / "policies" / "update-4")
    flags = {"model_name_or_path": policy_path, "dataset_name": dataset, "eval_split": "test",
             "prompt_column": "question", "answer_column": "answer", "temperature": 0.7, "response_length": 24,
             "eval_num_prompts": 64, "seed": 1}
    (run / "args.json").write_text(json.dumps({"args": flags}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"update": u, "eval/accuracy": 0.5}) + "\n" for u in (0, 4)))
    run_script(run, "--output", tmp_path / "dip.json", script="bench/dip_diagnostics.py")
    measured = json.loads((tmp_path / "dip.json").read_text())["run"]
    diagnostics = bench_module("dip_diagnostics")
    classes = measured["classes"]
    assert measured["update"] == [0, 4] and sum(c["problems"] for c in classes.values()) == 64
    for c in classes.values():
        assert c["accuracy"][0] == c["accuracy"][1] and c["decision"][0] == c["decision"][1]
    # the decision by hand: the policy's next-token probability at temperature 0.7 after the solution's prefix
    import datasets

    rows = datasets.load_from_disk(dataset)["test"].select(range(64))
    tokenizer, policy = AutoTokenizer.from_pretrained(policy_path), AutoModelForCausalLM.from_pretrained(policy_path)
    by_class = {c: [] for c in diagnostics.CLASSES}
    greedy_right = {c: [] for c in diagnostics.CLASSES}
    for question, solution, a, b in zip(rows["question"], rows["answer"], rows["a"], rows["b"]):
        prefix, decision = diagnostics.decision_split(solution)
        assert decision == ("+" if a % 10 + b % 10 >= 10 else "=")
        ids = tokenizer(question)["input_ids"] + tokenizer(prefix)["input_ids"]
        with torch.no_grad():
            logits = policy(torch.tensor([ids])).logits[0, -1] / 0.7
        by_class[diagnostics.problem_class(a, b)].append(
            torch.softmax(logits, -1)[tokenizer.convert_tokens_to_ids(decision)].item())
        output = policy.generate(torch.tensor([tokenizer(question)["input_ids"]]), max_new_tokens=24, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        completion = tokenizer.decode(output[0, len(tokenizer(question)["input_ids"]):], skip_special_tokens=True)
        greedy_right[diagnostics.problem_class(a, b)].append(toy.states_the_sum(completion, a, b))
    for c in diagnostics.CLASSES:
        assert classes[c]["decision"][0] == pytest.approx(sum(by_class[c]) / len(by_class[c]), abs=1e-5)
        assert abs(classes[c]["accuracy"][0] * classes[c]["problems"] - sum(greedy_right[c])) <= 1, c


def test_a_sweep_records_the_world_its_runs_were_made_in(tmp_path):
    """The starting policy's weights' sha256 (its safetensors files, in order) and the CPU, from a run's args.json."""
    import hashlib

    bench = bench_module("off_policy_corrections")
    policy, run = tmp_path / "policy", tmp_path / "run"
    policy.mkdir()
    run.mkdir()
    (policy / "model-00001.safetensors").write_bytes(b"one")
    (policy / "model-00002.safetensors").write_bytes(b"two")
    (run / "args.json").write_text(json.dumps({"args": {"model_name_or_path": str(policy)}}))
    world = bench.world(str(run))
    assert world["policy_sha256"] == hashlib.sha256(b"onetwo").hexdigest()
    assert world["cpu"] and isinstance(world["avx512"], bool)


def test_the_turn_credit_table_pairs_each_estimator_with_episode_of_the_same_seed():
    """bench/turn_credit.py's table and its choice of phase two's estimator, on hand-made evaluations: updates to
    the target per seed, the paired difference over the seeds where both reach it, the drift of the turns."""
    turn_credit = bench_module("turn_credit")

    def evals(returns, turns):
        return [{"update": 4 * i, "return": r, "turns": t} for i, (r, t) in enumerate(zip(returns, turns))]

    arms = {"episode": {1: evals([1.0, 1.5, 1.9], [3, 3.5, 4]), 2: evals([1.0, 1.85, 1.9], [3, 3, 3])},
            "unbiased": {1: evals([1.0, 1.8, 2.0], [3, 4, 4.5]), 2: evals([1.0, 1.2, 1.7], [3, 2.5, 2])},
            "gigpo": {1: evals([1.0, 1.9, 1.9], [3, 3, 3]), 2: evals([1.0, 1.8, 1.9], [3, 3, 3])}}
    rows = turn_credit.table({"probe": {"sync": arms}}, {"probe": 1.8})
    assert rows[0] == "probe (toy:probe_answer_shaped), sync: target return 1.8"
    assert rows[4] == "| episode | 1: 8, 2: 4 |  | 1.90 (1.90 to 1.90) |  | +0.50 (+0.00 to +1.00) |  |"
    # seed 1: 4 - 8; seed 2 never reaches 1.8: no pair. Last returns 2.0 and 1.7 against 1.9 and 1.9. Drifts +1.5
    # and -1, against episode's +1 and 0
    assert rows[5] == ("| unbiased | 1: 4, 2: - | -4.0 (-4.0 to -4.0) | 1.85 (1.70 to 2.00) | -0.05 (-0.20 to +0.10) "
                       "| +0.25 (-1.00 to +1.50) | -0.25 (-1.00 to +0.50) |")
    assert rows[6] == ("| gigpo | 1: 4, 2: 4 | -2.0 (-4.0 to +0.0) | 1.90 (1.90 to 1.90) | +0.00 (+0.00 to +0.00) | "
                       "+0.00 (+0.00 to +0.00) | -0.50 (-1.00 to +0.00) |")
    # unbiased misses the target in a seed; gigpo's median (4) beats episode's (6)
    assert turn_credit.soonest(arms, 1.8) == "gigpo"
    # sooner in every seed (at the first evaluation), but fallen below the target by the end (median of the last
    # returns 1.6): held at 1.5, not at 1.8
    falls = {"turn_index_norm": {1: evals([1.85, 1.9, 1.5], [3, 2, 1]), 2: evals([1.85, 1.9, 1.7], [3, 2, 1])}}
    assert turn_credit.soonest(arms | falls, 1.8) == "gigpo"
    assert turn_credit.soonest(arms | falls, 1.5) == "turn_index_norm"
    assert turn_credit.soonest({"episode": arms["episode"], "unbiased": arms["unbiased"]}, 1.8) == "episode"


def test_the_turn_credit_benchmark_reads_finished_runs_and_plays_phase_two_on_its_own_seeds(tmp_path):
    """Runs with their `done` marker are read, not run again (here every run is finished, so none starts); phase
    two plays `episode` and phase one's soonest estimator on --async_seeds alone; results.json holds what was read."""
    turn_credit = bench_module("turn_credit")
    curves = {"episode": [1.0, 1.5, 1.96], "gigpo": [1.0, 1.96, 2.0]}  # gigpo reaches 1.95 first
    for mode, estimators in (("sync", turn_credit.ESTIMATORS), ("k1", curves), ("inflight", curves)):
        for estimator in estimators:
            for seed in (1, 2, 3):
                run = tmp_path / f"probe-{mode}-{estimator}-seed{seed}"
                run.mkdir()
                (run / "done").touch()
                returns = curves.get(estimator, [1.0, 1.2, 1.4])
                (run / "metrics.jsonl").write_text("".join(
                    json.dumps({"update": 2 * i, "eval/return_mean": r, "eval/turns_mean": 4.0}) + "\n"
                    for i, r in enumerate(returns)))
    turn_credit.main(turn_credit.Args(envs=("probe",), probe_target=1.95, async_seeds=(2,),
                                      output_dir=str(tmp_path)))
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["targets"]["probe"] == 1.95
    assert sorted(results["runs"]["probe"]["sync"]["unbiased"]) == ["1", "2", "3"]
    for mode in ("k1", "inflight"):
        assert {estimator: sorted(by_seed) for estimator, by_seed in results["runs"]["probe"][mode].items()} == {
            "episode": ["2"], "gigpo": ["2"]}
    assert results["runs"]["probe"]["k1"]["gigpo"]["2"][1] == {"update": 2, "return": 1.96, "turns": 4.0}


@pytest.mark.slow
@pytest.mark.heavy
def test_agent_speedup_quick(tmp_path):
    """Sync and in flight on toy:hops with 0.1 s log-normal steps, 4 updates: each row is its runs' numbers, every
    snapshot (and the SFT policy) evaluated after the run, and every step took time."""
    run_script("--quick", "--output_dir", tmp_path, script="bench/agent_speedup.py")
    table = json.loads((tmp_path / "results.json").read_text())["table"]["0.1"]
    for arm in ("sync", "inflight"):
        run_dir = tmp_path / f"{arm}-latency0.1-seed1"
        evaluations = json.loads((run_dir / "evaluations.json").read_text())
        assert sorted(evaluations) == ["0", "2", "4"]
        [run] = table[arm]["runs"]
        assert [(p["update"], p["return"]) for p in run["points"]] == [(int(u), r) for u, r in evaluations.items()]
        assert table[arm]["last_return"] == [evaluations["4"]]
        updates = [m for m in read_metrics(run_dir) if "loss/policy_avg" in m]
        assert len(updates) == 4 and all(m["env/step_time_median"] > 0 for m in updates)
    assert table["bound"] >= 1 and len(table["inflight_vs_sync"]["seconds_per_update"]) == 1


def agent_run(folder, launched: float, ends: list[float], returns: dict[int, float], phases: dict[str, float]):
    """A finished run of bench/agent_speedup.py made by hand: its `done` marker (launched at `launched`), an update's
    metrics line ending at each of `ends` with `phases` (seconds), its snapshots' evaluations, and its args.json
    naming a starting policy whose one weights file holds b"weights"."""
    folder.mkdir(parents=True)
    (folder / "start").mkdir()
    (folder / "start" / "model.safetensors").write_bytes(b"weights")
    (folder / "args.json").write_text(json.dumps({"args": {"model_name_or_path": str(folder / "start")}}))
    (folder / "done").write_text(json.dumps({"launched": launched}))
    (folder / "metrics.jsonl").write_text("".join(
        json.dumps({"update": u, "time": end, "loss/policy_avg": 0.0, **phases}) + "\n"
        for u, end in enumerate(ends, start=1)))
    (folder / "evaluations.json").write_text(json.dumps(returns))


def test_the_agent_benchmarks_clocks_levels_areas_and_intervals_on_hand_computed_numbers(tmp_path):
    """bench/agent_speedup.py: a snapshot's time from launch and from update 1's start (update 1's end less its
    phases), the first snapshot at a level, the mean return over a horizon (trapezoids, the last return held), the
    bootstrap interval of a median, and the paired comparison of an arm with sync."""
    bench = bench_module("agent_speedup")
    sync_phases = {"time/generate": 50.0, "time/score": 1.0, "time/train": 9.0}  # update 1 began 60 s before its end
    agent_run(tmp_path / "sync", 1000.0, [1120.0, 1180.0, 1240.0, 1300.0], {0: 0.3, 2: 0.5, 4: 0.7}, sync_phases)
    sync = bench.read_run(tmp_path / "sync", "sync", {0: 0.3, 2: 0.5, 4: 0.7})
    assert [(p["update"], p["minutes"], p["minutes_from_update_1"]) for p in sync["points"]] == [
        (0, 0.0, 0.0), (2, 3.0, 2.0), (4, 5.0, 4.0)]
    assert sync["fill_minutes"] == 2.0 and sync["seconds_per_update"] == 60.0
    assert bench.first_reaching(sync, 0.5, "minutes") == 3.0 and bench.first_reaching(sync, 0.6, "update") == 4
    assert bench.first_reaching(sync, 0.8, "minutes") is None
    # from launch, over 5 minutes: (0.3 + 0.5) / 2 * 3 + (0.5 + 0.7) / 2 * 2 = 2.4, over 5; over 10, 0.7 held 5 more
    assert abs(bench.mean_return(sync, "minutes", 5.0) - 2.4 / 5) < 1e-12
    assert abs(bench.mean_return(sync, "minutes", 10.0) - (2.4 + 3.5) / 10) < 1e-12
    assert abs(bench.mean_return(sync, "minutes", 1.5) - (0.3 + 0.4) / 2) < 1e-12  # cut inside the first segment
    assert bench.median_interval([2.0] * 5, 100) == (2.0, 2.0, 2.0)
    middle, low, high = bench.median_interval([1.0, 2.0, 3.0, 4.0, 5.0], 2000)
    assert middle == 3.0 and 1.0 <= low < 3.0 < high <= 5.0
    assert bench.bound({"time/generate": 30.0, "time/train": 10.0}) == 4 / 3

    # an arm twice as fast per update that needs one update more to each level (its snapshots every update)
    fast_phases = {"time/wait": 25.0, "time/score": 1.0, "time/train": 4.0, "time/weight_send": 0.0}
    agent_run(tmp_path / "fast", 1000.0, [1090.0, 1120.0, 1150.0, 1180.0],
              {0: 0.3, 1: 0.3, 2: 0.4, 3: 0.5, 4: 0.7}, fast_phases)
    fast = bench.read_run(tmp_path / "fast", "inflight", {0: 0.3, 1: 0.3, 2: 0.4, 3: 0.5, 4: 0.7})
    assert fast["fill_minutes"] == 1.5 and fast["seconds_per_update"] == 30.0
    versus = bench.compare({1: sync}, {1: fast}, bench.Args(levels=(0.5, 0.9)))
    # to 0.5: sync at 3 min from launch (2 from update 1), the arm at 2.5 (1.5: update 1 began at 1060)
    assert versus["levels"][0.5] == {"updates_more": [1], "minutes": [3.0 / 2.5], "minutes_from_update_1": [2.0 / 1.5]}
    assert versus["levels"][0.9] == {"updates_more": [], "minutes": [], "minutes_from_update_1": []}
    assert versus["seconds_per_update"] == [2.0]
    horizon = 5.0  # sync's last snapshot from launch; the arm's points at 0, 1.5, 2, 2.5, 3 min, then 0.7 held
    arm_area = (0.3 * 1.5 + 0.35 * 0.5 + 0.45 * 0.5 + 0.6 * 0.5 + 0.7 * 2) / horizon
    assert abs(versus["mean_return"]["minutes"][0] - arm_area / (2.4 / 5)) < 1e-12


def test_two_batches_in_flight_are_compared_with_one_seed_by_seed(tmp_path):
    """inflight2 (--inflight_batches 2) is compared with sync, as every arm, and with inflight of the same seed:
    in flight's seconds per update over inflight2's, its time to each level over inflight2's."""
    bench = bench_module("agent_speedup")
    phases = {"time/wait": 5.0, "time/score": 1.0, "time/train": 4.0, "time/weight_send": 0.0}
    # updates of 60, 30 and 20 s; the turns of the batches' episodes and, in flight, each token's staleness
    for arm, seconds, held in (("sync", 60.0, {"time/generate": 50.0, "time/train": 9.0, "rollout/turns_mean": 4.0}),
                               ("inflight", 30.0, phases | {"rollout/turns_mean": 3.0,
                                                            "async/token_staleness_mean": 1.0}),
                               ("inflight2", 20.0, phases | {"rollout/turns_mean": 2.5,
                                                             "async/token_staleness_mean": 2.0})):
        agent_run(tmp_path / "runs" / f"{arm}-latency0.5-seed1", 0.0, [seconds * u for u in range(1, 5)],
                  {0: 0.3, 2: 0.4, 4: 0.6}, held)
    bench.main(bench.Args(arms=("sync", "inflight", "inflight2"), latencies=(0.5,), seeds=(1,), updates=4,
                          snapshot_every=2, levels=(0.5,), bootstrap=100, output_dir=str(tmp_path / "runs"),
                          results_file=None, records_dir=str(tmp_path / "kept")))
    results = json.loads((tmp_path / "runs" / "results.json").read_text())
    versus = results["table"]["0.5"]["inflight2_vs_inflight"]
    assert versus["seconds_per_update"] == [1.5] and versus["levels"]["0.5"]["minutes"] == [1.5]
    assert results["table"]["0.5"]["inflight2_vs_sync"]["seconds_per_update"] == [3.0]
    passage = bench_module("findings").agent_findings(results)
    assert ("- inflight2 against inflight (inflight's time over the arm's, per seed): to 0.5, from launch 1.50x (one "
            "seed)") in passage
    assert ("What the batches held: turns per episode over the last 10 updates (median over the seeds) sync 4.00, "
            "inflight 3.00, inflight2 2.50; a token's staleness over the run (versions behind the trained weights) "
            "inflight 1.00, inflight2 2.00.") in passage


def test_runs_that_sample_alike_are_checked_for_the_same_returns_seed_by_seed():
    """findings: sync's evaluated returns with latency against without, and K = 1's against continuous's, seed by
    seed, where both ran on one machine (seed 1 the same, seed 2 not, seed 3 on two machines: left out)."""
    def run(returns, boot="a"):
        return {"points": [{"return": r} for r in returns], "machine": {"cpu": "x", "boot_id": boot}}

    table = {"0.0": {"sync": {"seeds": [1, 2, 3], "runs": [run([0.3, 0.5]), run([0.3, 0.5]), run([0.3, 0.4])]}},
             "0.5": {"sync": {"seeds": [1, 2, 3], "runs": [run([0.3, 0.5]), run([0.3, 0.6]), run([0.3, 0.4], "b")]},
                     "k1": {"seeds": [2, 3], "runs": [run([0.3, 0.6]), run([0.3, 0.4])]},
                     "continuous": {"seeds": [2, 3], "runs": [run([0.3, 0.6]), run([0.3, 0.5])]}}}
    assert bench_module("findings").alike(table, [1, 2, 3]) == (
        "Evaluated to the same return at every snapshot, the same seed on one machine: sync with latency 0.5 s and "
        "without, 1 of 2 seeds (seeds 1); K = 1 and continuous episodes at 0.5 s, 1 of 2 seeds (seeds 2).")


def test_the_agent_benchmark_reads_finished_runs_and_evaluations_and_writes_its_table(tmp_path):
    """Runs with their `done` marker and evaluations.json are read, neither run nor evaluated again (here all are,
    so nothing starts); results.json holds each arm's numbers and the ratios against sync, seed by seed."""
    bench = bench_module("agent_speedup")
    for seed in (1, 2):  # updates of 60 s and 30 s, each the sum of its phases
        agent_run(tmp_path / "runs" / f"sync-latency0.5-seed{seed}", 0.0, [60.0 * u for u in range(1, 5)],
                  {0: 0.3, 2: 0.5, 4: 0.6}, {"time/generate": 50.0, "time/score": 1.0, "time/train": 9.0})
        agent_run(tmp_path / "runs" / f"inflight-latency0.5-seed{seed}", 0.0, [30.0 * u for u in range(1, 5)],
                  {0: 0.3, 2: 0.4, 4: 0.5 + 0.1 * seed},
                  {"time/generate": 28.0, "time/wait": 25.0, "time/score": 1.0, "time/train": 4.0})
    args = dict(arms=("sync", "inflight"), latencies=(0.5,), seeds=(1, 2), updates=4, snapshot_every=2, levels=(0.5,),
                bootstrap=100, output_dir=str(tmp_path / "runs"), results_file=None, records_dir=str(tmp_path / "kept"))
    bench.main(bench.Args(**args))
    table = json.loads((tmp_path / "runs" / "results.json").read_text())["table"]["0.5"]
    assert table["sync"]["last_return"] == [0.6, 0.6] and table["inflight"]["last_return"] == [0.6, 0.7]
    assert table["bound"] == (50 + 9) / 50
    # to 0.5: sync at 2 min (update 2), in flight at 2 min as well (update 4, 30 s each): 1x, 2 updates more
    assert table["inflight_vs_sync"]["levels"]["0.5"] == {"updates_more": [2, 2], "minutes": [1.0, 1.0],
                                                         "minutes_from_update_1": [1.0, 1.0]}
    assert table["inflight_vs_sync"]["seconds_per_update"] == [2.0, 2.0] and table["inflight_vs_sync"]["unpaired"] == 0
    # RESULTS' passage of it: each ratio as the median of the seeds' with its bootstrap interval, then each seed's
    # (update 1 of the in-flight runs began at launch: its 30 s are all phases)
    passage = bench_module("findings").agent_findings(json.loads((tmp_path / "runs" / "results.json").read_text()))
    assert "seconds per update median 2.00x [2.00x, 2.00x] over 2 seeds (2.00x, 2.00x)" in passage
    assert "to 0.5, from launch median 1.00x [1.00x, 1.00x] over 2 seeds (1.00x, 1.00x)" in passage
    assert "| inflight (seed 2) | 30.0 | 0.50 | 0.30, 0.40, 0.70 | 4, 2.0, 2.0 |" in passage

    # the records stand for the runs, which need not be there (another sitting, another machine): nothing is run
    shutil.rmtree(tmp_path / "runs")
    kept = tmp_path / "kept" / "sync-latency0.5-seed2.json"
    elsewhere = json.loads(kept.read_text())
    assert elsewhere["command"][:2] == ["--env", "toy:hops"] and elsewhere["machine"]["boot_id"]
    assert elsewhere["world"]["policy_sha256"] == hashlib.sha256(b"weights").hexdigest()
    elsewhere["machine"]["boot_id"] = "another-boot"  # seed 2's sync ran on another machine than its in-flight run
    kept.write_text(json.dumps(elsewhere))
    bench.main(bench.Args(**args))
    table = json.loads((tmp_path / "runs" / "results.json").read_text())["table"]["0.5"]
    assert table["sync"]["last_return"] == [0.6, 0.6]
    assert table["inflight_vs_sync"]["seconds_per_update"] == [2.0] and table["inflight_vs_sync"]["unpaired"] == 1

    # --recorded_only: the records there are, an arm's seed without one left out (sync's seed 1 not yet made); no run
    (tmp_path / "kept" / "sync-latency0.5-seed1.json").unlink()
    bench.main(bench.Args(**args, recorded_only=True))
    table = json.loads((tmp_path / "runs" / "results.json").read_text())["table"]["0.5"]
    assert table["sync"]["seeds"] == [2] and table["inflight"]["seeds"] == [1, 2]
    assert table["inflight_vs_sync"]["seconds_per_update"] == [] and table["inflight_vs_sync"]["unpaired"] == 2
    assert os.listdir(tmp_path / "runs") == ["results.json"]  # nothing run
    passage = bench_module("findings").agent_findings(json.loads((tmp_path / "runs" / "results.json").read_text()))
    assert "| sync (seed 2) |" in passage and "| sync (seed 1) |" not in passage and "| inflight (seed 1) |" in passage
    assert "(2 seeds left out: no sync run on their machine)" in passage
    build = hashlib.sha256(b"weights").hexdigest()[:8]  # the runs' machines and builds, each with its arms' seeds
    assert f"boot another-, build {build}, starting policy evaluated at 0.300: sync seed 2;" in passage
    assert f", build {build}, starting policy evaluated at 0.300: inflight seeds 1, 2." in passage

    # a record made with other flags is not taken for this benchmark's run
    with pytest.raises(SystemExit, match="inflight-latency0.5-seed1.json was made with other flags"):
        bench.main(bench.Args(**(args | {"extra": "--num_epochs 2"})))


def test_tool_templates_keeps_each_templates_outcome(tmp_path):
    """bench/tool_templates.py --results_file: one outcome per template tried, the counts it prints, the versions."""
    printed = run_script("--every", "100", "--results_file", tmp_path / "t.json",
                         script="bench/tool_templates.py").stdout
    kept = json.loads((tmp_path / "t.json").read_text())
    assert len(kept["outcomes"]) == len(bench_module("tool_templates").templates(100)) > 1
    assert f"| {len(kept['outcomes'])} chat templates | count |" in printed
    assert set(kept["versions"]) == {"chatlint", "transformers"} and kept["every"] == 100
    for outcome in set(kept["outcomes"].values()):
        assert f"| {outcome} | {list(kept['outcomes'].values()).count(outcome)} |" in printed


@pytest.mark.slow
def test_generation_speed_keeps_every_rounds_seconds(tmp_path):
    """bench/generation_speed.py --results_file: each size's rounds, both sides, the model's size and the machine."""
    printed = run_script("--hidden_sizes", "128", "--rows", "4", "--new_tokens", "4", "--repeats", "2",
                         "--results_file", tmp_path / "g.json", script="bench/generation_speed.py").stdout
    kept = json.loads((tmp_path / "g.json").read_text())
    size = kept["sizes"]["128"]
    assert len(size["hf_seconds"]) == len(size["vllm_seconds"]) == 2 and min(size["vllm_seconds"]) > 0
    assert size["parameters"] == 8192 * 128 * 2 + 2 * (4 * 128 * 128 + 3 * 128 * 384 + 2 * 128) + 128
    assert kept["machine"]["boot_id"] and kept["torch_threads"] == 1 and "128" in printed


@pytest.mark.slow
def test_default_runs_and_async_speedup_keep_every_run(tmp_path):
    """bench/default_runs.py keeps a run's evaluations as its metrics logged them, with its build; async_speedup.py
    --results_file keeps every round's numbers beside their medians (what findings.py pairs per round)."""
    run_script("--runs", "grpo_multiturn", "--results_file", tmp_path / "d.json", script="bench/default_runs.py")
    [run] = json.loads((tmp_path / "d.json").read_text())["runs"].values()
    assert run["command"] == ["python", "grpo_multiturn.py"] and run["score"] == "return_mean"
    assert run["updates"][0] == 0 and run["updates"][-1] == 40 and run["scores"][-1] > run["scores"][0]
    assert len(run["world"]["policy_sha256"]) == 64 and run["seconds"] > 0
    run_script("--updates", "3", "--prompts_per_update", "16", "--settings", "hf", "k1", "--repeats", "2",
               "--results_file", tmp_path / "a.json", script="bench/async_speedup.py")
    kept = json.loads((tmp_path / "a.json").read_text())
    assert kept["args"]["repeats"] == 2 and kept["world"]["policy_sha256"] and kept["machine"]["boot_id"]
    for setting in ("hf", "k1"):
        runs = kept["settings"][setting]["runs"]
        assert len(runs) == 2 and kept["settings"][setting]["seconds_per_update"] == pytest.approx(
            statistics.median(r["seconds_per_update"] for r in runs))
    assert kept["settings"]["k1"]["staleness"] == 1
