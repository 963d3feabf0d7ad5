"""Multi-rank correctness: every script on two ranks under the deepspeed launcher (ZeRO 2 and 3,
resume on two ranks), and the distributed helpers on two real ranks."""

import shutil

import pytest
from scripts import QUICK, SCRIPTS, assert_same_weights_and_metrics, load_policy_weights, read_metrics, run_script

TWO_RANKS = ("deepspeed", "--num_gpus", "2", "--master_port")


@pytest.mark.parametrize(("script", "zero_stage"), [
    (script, stage) for script in SCRIPTS for stage in (2, 3)
    if (script, stage) != ("online_dpo_vllm.py", 2)])  # that one is test_online_dpo_vllm's two-rank run
def test_two_ranks_under_the_deepspeed_launcher(tmp_path, script, zero_stage):
    """Two ranks of 16 prompts each. With ZeRO-3 the run also checkpoints at update 2 and a copy of it
    resumes from that checkpoint on two ranks (the state of a run killed right after the checkpoint:
    only the latest checkpoint is kept), ending with the same weights and metrics, bit for bit."""
    out = tmp_path / "run"
    port = 29600 + 10 * SCRIPTS.index(script) + zero_stage
    updates = 3 if zero_stage == 3 else 2
    args = [*QUICK, "--total_episodes", 32 * updates, "--eval_every", "1", "--save_every", "2",
            "--zero_stage", zero_stage]
    launcher, env = (*TWO_RANKS, str(port)), {"OMP_NUM_THREADS": "1"}
    run_script(*args, "--output_dir", out, script=script, launcher=launcher, env=env)
    metrics = read_metrics(out)
    # 16 prompts per rank per update, counted over both ranks
    assert [m["episode"] for m in metrics if "loss/policy_avg" in m] == [32 * (u + 1) for u in range(updates)]
    assert [m["update"] for m in metrics if "eval/gold_win_rate" in m] == list(range(updates + 1))
    assert load_policy_weights(out)  # gathered from both ranks, loads with from_pretrained
    if zero_stage == 3:
        resumed = tmp_path / "resumed"
        shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("policy", "wandb"))
        assert [p.name for p in (resumed / "checkpoints").iterdir()] == ["update-2"]
        run_script(*args, "--output_dir", resumed, "--resume", script=script, launcher=launcher, env=env)
        assert_same_weights_and_metrics(out, resumed, ["loss/policy_avg", "objective/scores", "eval/gold_win_rate"])


# The distributed helpers on two real ranks (gloo): what every script relies on for its metrics and data.
TWO_RANK_HELPERS = """
import sys
sys.path.insert(0, ".")
import torch, common
rank, world_size = common.init_distributed()
assert world_size == 2
assert common.all_reduce_mean({"a": float(rank), "b": 10.0 * rank}) == {"a": 0.5, "b": 5.0}
indices = [common.PromptSampler(100, 8, rank, world_size, seed=1).next_indices() for _ in range(1)][0]
everyone = [None, None]
torch.distributed.all_gather_object(everyone, indices)
assert len(set(everyone[0]) | set(everyone[1])) == 16, everyone  # disjoint shares of one global batch
scores = torch.tensor([1.0, float("nan") if rank == 1 else 2.0])
try:
    common.check_rewards(scores, update=7)
    raise AssertionError("a NaN on rank 1 did not stop rank 0")
except SystemExit as stop:  # every rank stops, not only the one that saw the NaN
    assert "update 7" in str(stop.code) and "for 1 of 4 completions" in str(stop.code)
print(f"rank {rank} ok")
"""


def test_metrics_and_data_across_two_real_ranks(tmp_path):
    check = tmp_path / "two_rank_check.py"
    check.write_text(TWO_RANK_HELPERS)
    result = run_script(check, script="", launcher=("torchrun", "--nproc_per_node", "2", "--master_port", "29699"),
                        env={"OMP_NUM_THREADS": "1"})
    assert "rank 0 ok" in result.stdout and "rank 1 ok" in result.stdout
