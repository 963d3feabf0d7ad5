"""Runs the script named by the first argument with one of the reward model's scores made NaN at the
third training rollout (evaluation does not go through common.reward_model_scores).

    PYTHONPATH=. python tests/run_with_nan_reward.py online_dpo.py --total_episodes 64 ...
"""

import runpy
import sys

import common


def nan_at_third_call(reward_model_scores):
    calls = []

    def scores_with_nan(*args, **kwargs):
        scores = reward_model_scores(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            scores[1] = float("nan")
        return scores

    return scores_with_nan


if __name__ == "__main__":
    common.reward_model_scores = nan_at_third_call(common.reward_model_scores)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
