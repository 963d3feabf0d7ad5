"""The embedded arithmetic task (toy.build_math) and the scripts on it: the task is what it says, and
scripts not covered by bench/math_sync_vs_async.py --quick (online DPO, sync and async, in test_bench.py) and
test_grpo.py (GRPO as DAPO) learn it too: best-of-k, and PPO through its vLLM twin (ppo.py's loss is the same
code, and it learns the toy task in test_ppo.py)."""

import json
import random

import pytest
from scripts import read_metrics, run_script

import math_reward
import toy


@pytest.mark.slow
def test_problems_solutions_and_their_tokens():
    first, second = toy.math_splits(random.Random(0)), toy.math_splits(random.Random(0))
    assert first["train"].to_dict() == second["train"].to_dict() and first["test"].to_dict() == second["test"].to_dict()
    tokenizer = toy.make_math_tokenizer()
    for a, b, solution in zip(first["test"]["a"], first["test"]["b"], first["test"]["answer"]):
        assert math_reward.final_answer(solution) == a + b
        assert tokenizer.decode(tokenizer(solution)["input_ids"]) == solution  # numbers come back whole
    carrying = [a % 10 + b % 10 >= 10 for a, b in zip(first["train"]["a"], first["train"]["b"])]
    assert sum(carrying) / len(carrying) == pytest.approx(toy.CARRY_SHARE, abs=0.02)
    assert toy.worked_solution(37, 48) == " 7 + 8 = 15 , 3 + 4 + 1 = 8 #### 85"
    assert toy.worked_solution(37, 48, forget_carry=True) == " 7 + 8 = 15 , 3 + 4 = 7 #### 75"


@pytest.mark.slow
def test_the_sft_policy_is_right_about_a_third_of_the_time():
    toy.build_math()
    with open(f"{toy.MATH_DIR}/summary.json") as f:
        summary = json.load(f)
    assert 0.30 <= summary["sft_greedy_accuracy"] <= 0.45, summary
    assert summary["sft_sampled_accuracy"] > summary["sft_greedy_accuracy"]  # sampling finds more: room for RL


SHORT = ["--preset", "toy-math", "--total_episodes", "768", "--eval_every", "12", "--eval_num_prompts", "64"]


@pytest.mark.slow
@pytest.mark.parametrize("script", [pytest.param("bok", marks=pytest.mark.heavy), "ppo_vllm"])  # bok: heavy
def test_the_other_scripts_learn_arithmetic(tmp_path, script):
    out = tmp_path / "run"
    run_script(*SHORT, "--output_dir", out, script=f"{script}.py")
    accuracy = [m["eval/accuracy"] for m in read_metrics(out) if "eval/accuracy" in m]
    assert len(accuracy) == 2 and accuracy[0] < 0.5 and accuracy[1] >= 0.8, accuracy  # measured 0.41 -> 0.92, 1.0
