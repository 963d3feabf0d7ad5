"""The paper-finding benchmarks in --quick mode: they run end to end and report every cell."""

import json

from scripts import run_script


def test_off_policy_quick(tmp_path):
    result = run_script("--quick", "--output_dir", tmp_path, script="bench/off_policy.py")
    table = json.loads((tmp_path / "results.json").read_text())["table"]
    assert sorted(table) == ["bok.py", "online_dpo.py", "ppo.py", "rloo.py"]
    for row in table.values():
        assert sorted(row["win_rate"]) == ["1", "4"]
        assert all(0 <= w <= 1 for runs in row["win_rate"].values() for w in runs)
        assert row["drop"] == sum(row["win_rate"]["1"]) - sum(row["win_rate"]["4"])  # one seed
    assert "smallest drop from 1 to 4 mini-batches" in result.stdout
    assert len(list(tmp_path.glob("*-mb4-seed1/policy"))) == 4


def test_sync_vs_async_quick(tmp_path):
    result = run_script("--quick", "--output_dir", tmp_path, script="bench/sync_vs_async.py")
    table = json.loads((tmp_path / "results.json").read_text())["table"]
    assert sorted(table) == ["async", "sync HF"]
    for row in table.values():
        assert len(row["final_win_rates"]) == 1 and row["total_minutes"] > 0
    assert (tmp_path / "win_rate_vs_time.png").stat().st_size > 10_000
    assert "async vs sync HF: total time" in result.stdout
