"""The kit's layout promises: a synchronous script never imports vLLM, the embedded tasks and the
math reward import nothing of the kit (no import circle), and the toy's own answer check agrees with
the math reward's on the arithmetic task."""

import subprocess
import sys

from scripts import ROOT, environment

KIT_MODULES = ("cli", "common", "corrections", "data", "evaluation", "lora", "vllm_generator", "math_reward",
               "online_dpo", "online_dpo_vllm", "ppo", "ppo_vllm", "rloo", "rloo_vllm", "bok", "grpo", "grpo_vllm",
               "sft", "reward_model", "eval_checkpoints")


def modules_after_import(*names: str) -> set[str]:
    """The modules a fresh interpreter has loaded after importing `names`."""
    code = f"import sys\nimport {', '.join(names)}\nprint(' '.join(sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environment(), capture_output=True,
                            text=True, check=True)
    return set(result.stdout.split())


def test_the_synchronous_scripts_import_no_vllm_code():
    loaded = modules_after_import("online_dpo", "ppo", "rloo", "bok", "grpo", "sft", "reward_model",
                                  "eval_checkpoints")
    assert {"common", "data"} <= loaded
    assert not {name for name in loaded if name == "vllm_generator" or name.split(".")[0] == "vllm"}


def test_the_toy_and_the_math_reward_import_nothing_of_the_kit():
    loaded = modules_after_import("toy", "math_reward")
    assert {"toy", "math_reward"} <= loaded and not set(KIT_MODULES) - {"math_reward"} & loaded


def test_the_toys_answer_check_agrees_with_the_math_reward():
    import math_reward
    import toy

    cases = [(37, 48, " 7 + 8 = 15 , 3 + 4 + 1 = 8 #### 85"), (37, 48, toy.worked_solution(37, 48, forget_carry=True)),
             (12, 30, toy.worked_solution(12, 30)), (12, 30, "#### 42 #### 7"), (12, 30, "no answer"),
             (99, 99, "#### 1,98"), (99, 99, "####198.0")]
    for a, b, completion in cases:
        assert toy.states_the_sum(completion, a, b) == math_reward.same_final_answer(
            completion, toy.worked_solution(a, b)), (a, b, completion)
    assert [toy.states_the_sum(c, a, b) for a, b, c in cases] == [True, False, True, True, False, True, True]
