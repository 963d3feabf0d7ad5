"""Runs the script named by the first argument with one of the reward model's scores made NaN at the
third training rollout (evaluation does not go through common.rollout_rewards).

    PYTHONPATH=. python tests/run_with_nan_reward.py online_dpo.py --total_episodes 64 ...
"""

import runpy
import sys

import common


def nan_at_third_call(rollout_rewards):
    calls = []

    def scores_with_nan(*args, **kwargs):
        scores = rollout_rewards(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            scores[1] = float("nan")
        return scores

    return scores_with_nan


if __name__ == "__main__":
    common.rollout_rewards = nan_at_third_call(common.rollout_rewards)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
