"""online_dpo.py: pair selection and the losses on hand-computed numbers (for both DPO scripts, which
each carry their own copy), and the script end to end on the toy task."""

import json
import math
import os
import shutil
import sys
from unittest import mock

import pytest
import torch
from scripts import (
    QUICK,
    SHORT_INTERRUPTIONS,
    SYNC_INTERRUPTIONS,
    assert_learns,
    assert_same_weights_and_metrics,
    assert_trained_policy_saved,
    interrupted_and_resumed,
    read_metrics,
    run_script,
)

import cli
import online_dpo
import online_dpo_vllm
import toy

DPO_SCRIPTS = [online_dpo, online_dpo_vllm]


@pytest.mark.parametrize("script", DPO_SCRIPTS, ids=lambda module: module.__name__)
def test_dpo_losses_on_hand_computed_numbers(script):
    chosen, rejected = torch.tensor([-1.0, -4.0, -2.0]), torch.tensor([-3.0, -1.0, -2.0])
    ref_chosen, ref_rejected = torch.tensor([-2.0, -2.0, -1.5]), torch.tensor([-2.0, -2.0, -1.5])
    # logits = (pi_c - pi_r) - (ref_c - ref_r) = [2, -3, 0]; the third pair is a tie of both
    sigmoid = script.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1, loss_type="sigmoid")
    assert sigmoid.tolist() == pytest.approx([math.log(1 + math.exp(-0.2)), math.log(1 + math.exp(0.3)),
                                              math.log(2)])
    ipo = script.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5, loss_type="ipo")
    assert ipo.tolist() == pytest.approx([(2 - 1) ** 2, (-3 - 1) ** 2, 1.0])


@pytest.mark.parametrize("script", DPO_SCRIPTS, ids=lambda module: module.__name__)
def test_pairs_are_best_vs_worst_and_ties_are_masked(script):
    scores = torch.tensor([0.5, 2.0, -1.0,  # best is row 1, worst row 2
                           3.0, 3.0, 3.0,  # all tie: no preference, masked
                           1.0, 4.0, 4.0,  # tied best: the first of them
                           -2.0, 0.0, -2.0])  # tied worst: the first of them
    chosen, rejected, valid = script.best_and_worst(scores, k=3)
    assert chosen.tolist() == [1, 3, 7, 10]
    assert rejected.tolist() == [2, 3, 6, 9]
    assert valid.tolist() == [1.0, 0.0, 1.0, 1.0]


# 5 updates of 16 prompts, evaluated after each on 32, checkpointed and snapshotted every 2
RUN = [*QUICK, "--total_episodes", "80", "--eval_every", "1", "--save_every", "2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A short run (RUN), uninterrupted."""
    out = tmp_path_factory.mktemp("online_dpo") / "whole"
    run_script(*RUN, "--output_dir", out)
    return out


def test_logs_every_metric_to_jsonl(run):
    metrics = read_metrics(run)
    train = [m for m in metrics if "loss/policy_avg" in m]
    evals = [m for m in metrics if "eval/gold_win_rate" in m]
    assert [m["update"] for m in train] == [1, 2, 3, 4, 5] and [m["update"] for m in evals] == [0, 1, 2, 3, 4, 5]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected", "objective/scores", "objective/scores_margin", "objective/kl",
                 "objective/entropy", "objective/rlhf_reward", "loss/policy_avg", "val/num_eos_tokens", "lr",
                 "episode", "eps"):
        assert all(math.isfinite(m[name]) for m in train), name
    assert [m["episode"] for m in train] == [16, 32, 48, 64, 80]
    # chosen beats rejected by a margin on the non-tied pairs; most pairs are not ties
    assert all(m["objective/scores_margin"] > 0 and m["objective/tie_fraction"] < 0.5 for m in train)
    assert all(m["val/num_eos_tokens"] == int(m["val/num_eos_tokens"]) for m in train)  # a count, not a mean
    assert train[1]["lr"] < train[0]["lr"]  # linear decay
    assert evals[0]["eval/kl"] == pytest.approx(0, abs=1e-4)  # before any update the policy is the reference
    assert (run / "curves.png").stat().st_size > 10_000
    assert_trained_policy_saved(run)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["online_dpo.py", "bok.py"])
def test_logged_log_probs_mix_the_first_steps_forward_and_a_no_grad_one(tmp_path, script):
    # 4 samples a prompt and 2 mini-batches: the logged KL and entropy take some rows' log-probs from the
    # first optimizer step's forward and the rest from a no-grad forward; under the starting weights
    # both are the reference's, so the KL of update 1 is 0 unless a row was missed or came after the step
    run_script(*QUICK, "--total_episodes", "16", "--num_samples", "4", "--num_mini_batches", "2",
               "--gradient_accumulation_steps", "1", "--eval_every", "0", "--output_dir", tmp_path / "run",
               script=script)
    [update] = [m for m in read_metrics(tmp_path / "run") if "loss/policy_avg" in m]
    assert update["objective/kl"] == pytest.approx(0, abs=1e-5)
    assert 0.1 < update["objective/entropy"] < 10


@pytest.mark.slow
def test_short_run_beats_the_sft_policy_and_logs_to_wandb_offline(tmp_path):
    # DPO at lr 1e-4 needs about 10 updates to learn to stop
    run_script("--total_episodes", "640", "--eval_every", "1000", "--track", "--output_dir", tmp_path / "run")
    assert_learns(tmp_path / "run")
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*")), "wandb offline run missing"


@pytest.fixture(scope="module")
def evaluated(run, tmp_path_factory):
    """eval_checkpoints.py on the run: its output directory."""
    out = tmp_path_factory.mktemp("eval") / "eval"
    run_script("--run_dir", run, "--output_dir", out, script="eval_checkpoints.py")
    return out


def test_eval_checkpoints_evaluates_every_snapshot_as_training_did(run, evaluated):
    # the run evaluated after every update and kept policies/update-2 and -4 and its final policy (5): the
    # table has the SFT start and those three, each with the numbers the run's own evaluation logged (an
    # evaluation samples with a seed of its own, from the run's seed and the update)
    table = [json.loads(line) for line in (evaluated / "eval.jsonl").read_text().splitlines()]
    trained = {m["update"]: m for m in read_metrics(run) if "eval/gold_win_rate" in m}
    assert [(row["update"], row["episode"]) for row in table] == [(0, 0), (2, 32), (4, 64), (5, 80)]
    for row in table:
        logged = trained[row["update"]]
        assert {name: value for name, value in row.items() if name.startswith("eval/")} == pytest.approx(
            {name: value for name, value in logged.items() if name.startswith("eval/")}, rel=1e-6, abs=1e-7)
    assert (evaluated / "eval.png").stat().st_size > 10_000
    assert len((evaluated / "eval.csv").read_text().splitlines()) == 5


@pytest.mark.slow
def test_an_interrupted_eval_checkpoints_evaluates_only_the_rest_to_the_same_table(run, evaluated, tmp_path):
    # stopped after two policies: a second call evaluates only the other two, to the same table
    out = tmp_path / "eval"
    shutil.copytree(evaluated, out)
    table = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    (out / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in table[:2]))
    result = run_script("--run_dir", run, "--output_dir", out, script="eval_checkpoints.py")
    assert "4 policies, 2 evaluated already" in result.stdout
    assert [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()] == table


@pytest.mark.slow
def test_eval_checkpoints_scores_a_given_model_folder_as_training_did(run, tmp_path):
    # --model_paths with no run: the folder's trained.json names its update (5), which seeds the evaluation
    out = tmp_path / "eval"
    run_script("--model_paths", run / "policy", "--eval_num_prompts", "32", "--output_dir", out,
               script="eval_checkpoints.py")
    [row] = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    logged = [m for m in read_metrics(run) if "eval/gold_win_rate" in m][-1]
    assert row["policy"] == str(run / "policy") and row["update"] == logged["update"] == 5
    assert {name: value for name, value in row.items() if name.startswith("eval/")} == pytest.approx(
        {name: value for name, value in logged.items() if name.startswith("eval/")}, rel=1e-6, abs=1e-7)


def test_resumes_after_a_kill_while_checkpointing_with_the_same_weights_and_metrics(run, tmp_path):
    resumed = interrupted_and_resumed(tmp_path, "online_dpo.py", RUN, SHORT_INTERRUPTIONS)
    assert_same_weights_and_metrics(run, resumed, ["loss/policy_avg", "objective/scores", "eval/gold_win_rate"])


@pytest.mark.slow
def test_resumes_after_preemptions_and_kills_with_the_same_weights_and_metrics(run, tmp_path):
    resumed = interrupted_and_resumed(tmp_path, "online_dpo.py", RUN, SYNC_INTERRUPTIONS)
    assert_same_weights_and_metrics(run, resumed, ["loss/policy_avg", "objective/scores", "eval/gold_win_rate"])


@pytest.mark.slow
def test_a_runs_args_json_repeats_it_exactly(tmp_path):
    first, again = tmp_path / "first", tmp_path / "again"
    run_script(*QUICK, "--total_episodes", "32", "--eval_every", "1", "--loss_type", "ipo", "--seed", "3",
               "--save_every", "1", "--keep_snapshots", "1", "--output_dir", first)
    run_script("--config", first / "args.json", "--output_dir", again)
    for run in (first, again):  # snapshots of updates 1 and 2, the newest kept
        assert [p.name for p in (run / "policies").iterdir()] == ["update-2"]

    def numbers(run) -> list[dict]:  # every logged number but the clock's
        return [{name: value for name, value in m.items() if name not in ("time", "eps") and "time/" not in name}
                for m in read_metrics(run)]

    # the trainable parameter counts, 2 updates, 3 evaluations
    assert numbers(first) == numbers(again) and len(numbers(first)) == 6
    assert_same_weights_and_metrics(first, again, ["loss/policy_avg"])


FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


@pytest.mark.slow
def test_an_args_json_written_before_the_flag_groups_replays_its_run(tmp_path):
    """A run's args.json written by the kit before its flags were grouped by kind (flat Args, toy paths given as
    toy: names; fixtures/): the flags parse to the same values, and the run it replays is, update by update and
    bit for bit, the run of the args.json that replay writes in today's form (both run here: a run's numbers
    differ across CPUs, so none recorded elsewhere is compared)."""
    recorded = os.path.join(FIXTURES, "online_dpo_args_before_flag_groups.json")
    with open(recorded) as f:
        flags = {name: value for name, value in json.load(f)["args"].items() if name != "config"}
    with mock.patch.object(sys, "argv", ["online_dpo.py", "--config", recorded]):
        parsed = cli.flag_values(cli.parse(online_dpo.Args))
    toy_paths = {"toy:sft_policy": toy.SFT_POLICY, "toy:reward_model": toy.REWARD_MODEL, "toy:dataset": toy.DATASET}
    assert {name: parsed[name] for name in flags} == {name: toy_paths.get(value, value) if isinstance(value, str)
                                                      else value for name, value in flags.items()}
    # a flag added since the recording (--lr_scheduler_type) takes its default, which is the old behaviour
    defaults = cli.flag_values(online_dpo.Args())
    assert {name: parsed[name] for name in set(parsed) - set(flags) - {"config"}} == {
        name: defaults[name] for name in set(parsed) - set(flags) - {"config"}} and parsed["config"] == recorded
    run_script("--config", recorded, "--output_dir", tmp_path / "old")
    run_script("--config", tmp_path / "old" / "args.json", "--output_dir", tmp_path / "new")
    with open(tmp_path / "new" / "args.json") as f:
        assert "loss_type" in json.load(f)["args"]
    assert len([m for m in read_metrics(tmp_path / "old") if "eval/gold_win_rate" in m]) == 3
    assert_same_weights_and_metrics(tmp_path / "old", tmp_path / "new",
                                    ["loss/policy_avg", "objective/scores", "eval/gold_win_rate"])


@pytest.mark.slow
def test_refuses_to_overwrite_a_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    result = run_script(*QUICK, "--output_dir", tmp_path, check=False)
    assert result.returncode != 0 and "is not empty; pass --resume" in result.stderr
