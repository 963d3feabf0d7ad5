"""The distributed helpers on two real ranks (gloo): what every script relies on for its metrics and
data. Run by test_metrics_and_data_across_two_real_ranks:

    PYTHONPATH=. torchrun --nproc_per_node 2 tests/two_rank_helpers.py
"""

import torch

import common
import data

rank, world_size = common.init_distributed()
assert world_size == 2
assert common.all_reduce_mean({"a": float(rank), "b": 10.0 * rank}) == {"a": 0.5, "b": 5.0}
indices = data.PromptSampler(100, 8, rank, world_size, seed=1).next_indices()
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
torch.distributed.barrier()
