"""Evaluation in the engine (the _vllm scripts' default): the engine evaluates the weights of each update due
(--eval_every) between its batches, and the trainer logs the numbers with that update when they arrive. They
are the numbers eval_checkpoints.py --vllm gives the same weights (the same seeds) and, greedy, the numbers the
trainer's own evaluation gives (--eval_in_trainer: HF generate, as before); the training is the same either way.
The same for grpo_multiturn_vllm.py's episodes."""

import json

import pytest
from scripts import QUICK, assert_same_weights_and_metrics, read_metrics, run_script

# K = 1, 4 updates of 16 prompts, evaluated at 0, 2 and 4 (the last two versions no batch samples with), greedy; at
# 3x the default learning rate, so that the greedy completions move by update 2 on every CPU's toy build (at the
# default, one build's were all still the SFT policy's; at 3e-4 the gold win-rate went 0 -> 0.19 -> 0.53 on another)
RUN = [*QUICK, "--total_episodes", "64", "--eval_every", "2", "--save_every", "2", "--async_steps", "1",
       "--eval_temperature", "0", "--learning_rate", "3e-4"]
TRAINING = ("loss/policy_avg", "objective/scores", "objective/kl", "logps/chosen", "async/staleness")
# grpo_multiturn_vllm.py: 4 updates of 8 rows x 4 episodes, evaluated greedily on 32 rows at 0, 2 and 4
EPISODES_RUN = ["--total_episodes", "128", "--per_device_train_batch_size", "8", "--eval_every", "2",
                "--eval_num_prompts", "32", "--eval_temperature", "0", "--async_steps", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine_evaluation")
    run_script(*RUN, "--output_dir", folder / "engine", script="online_dpo_vllm.py")
    run_script(*RUN, "--eval_in_trainer", "--output_dir", folder / "trainer", script="online_dpo_vllm.py")
    return folder


def evaluations(out) -> dict[int, dict]:
    found = [m for m in read_metrics(out) if "eval/gold_win_rate" in m]
    assert len({m["update"] for m in found}) == len(found)  # each once
    return {m["update"]: m for m in found}


@pytest.mark.slow
def test_the_engines_evaluation_gives_eval_checkpoints_numbers_for_the_same_weights(runs, tmp_path):
    engine = evaluations(runs / "engine")
    assert sorted(engine) == [0, 2, 4]
    run_script("--run_dir", runs / "engine", "--vllm", "--output_dir", tmp_path / "table", script="eval_checkpoints.py")
    table = [json.loads(line) for line in (tmp_path / "table" / "eval.jsonl").read_text().splitlines()]
    assert [row["update"] for row in table] == [0, 2, 4]
    for row in table:
        measured = {name: value for name, value in row.items() if name.startswith("eval/")}
        assert measured == pytest.approx({name: engine[row["update"]][name] for name in measured}, rel=1e-6,
                                         abs=1e-7), row["update"]
    # the versions it took, each its own: the KL estimate from sampled completions is 0 for the starting policy (its
    # own reference) and differs with the weights (below 0 at times while the policy has barely moved; the greedy
    # completions, and so the perplexity, can stay the same between two versions)
    assert engine[0]["eval/kl"] == 0 and len({engine[update]["eval/kl"] for update in (0, 2, 4)}) == 3
    # logged with the time of its update's line (that of the weights evaluated), though it came later
    lines = read_metrics(runs / "engine")
    trained_at = {m["update"]: m["time"] for m in lines if "loss/policy_avg" in m}
    assert all(engine[update]["time"] == trained_at[update] for update in (2, 4))
    assert [m["update"] for m in lines if "eval/gold_win_rate" in m][0] == 0
    assert lines.index(engine[0]) > [m["update"] for m in lines].index(1)  # version 0's arrived after update 1


@pytest.mark.slow
def test_evaluating_in_the_engine_leaves_the_training_as_it_is_and_greedy_scores_as_the_trainer(runs):
    """The same samples, losses and final weights as the run that evaluates in the trainer; greedy, the engine's
    completions are HF generate's, so every number but KL (from temperature samples: vLLM's and HF's differ) is
    the trainer's evaluation's."""
    assert_same_weights_and_metrics(runs / "trainer", runs / "engine", TRAINING)
    engine, trainer = evaluations(runs / "engine"), evaluations(runs / "trainer")
    assert sorted(trainer) == [0, 2, 4]
    for update in (0, 2, 4):
        names = [name for name in trainer[update] if name.startswith("eval/") and name != "eval/kl"]
        assert {name: engine[update][name] for name in names} == pytest.approx(
            {name: trainer[update][name] for name in names}, rel=1e-5, abs=1e-6), update
    assert engine[2]["eval/ref_perplexity"] != engine[0]["eval/ref_perplexity"]  # greedy, yet the policy moved


@pytest.mark.slow
def test_the_engine_plays_the_evaluation_episodes_as_the_trainer_would(tmp_path):
    """grpo_multiturn_vllm.py: the engine's greedy evaluation episodes (the trainer's rows and reset seeds) end as
    the trainer's own (HF generate) do, and the training is the same."""
    for name, flags in (("engine", []), ("trainer", ["--eval_in_trainer"])):
        run_script(*EPISODES_RUN, *flags, "--output_dir", tmp_path / name, script="grpo_multiturn_vllm.py")
    assert_same_weights_and_metrics(tmp_path / "trainer", tmp_path / "engine",
                                    ("loss/policy_avg", "rollout/return_mean", "async/staleness"))
    played = [{m["update"]: m for m in read_metrics(tmp_path / name) if "eval/return_mean" in m}
              for name in ("engine", "trainer")]
    assert sorted(played[0]) == sorted(played[1]) == [0, 2, 4]
    for update in (0, 2, 4):
        for name in ("eval/return_mean", "eval/turns_mean", "eval/truncated_episodes"):
            assert played[0][update][name] == pytest.approx(played[1][update][name], abs=1e-6), (update, name)
