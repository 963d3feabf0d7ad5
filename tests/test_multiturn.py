"""grpo_multiturn.py and environments.py: the environment's tokens never reach the loss, the ids trained are the
ids sampled, a group shares its initial state, every way an environment breaks the contract stops the run on one
line, the default run learns guess-the-number, resume is exact, and a researcher's environment trains a chat
model."""

import dataclasses
import json
import os
import re
import time

import pytest
import torch
from own_inputs import byte_level_bpe_tokenizer
from scripts import (
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
import grpo_multiturn
import toy


@pytest.fixture(scope="module")
def guess_task():
    """The guess-the-number task as the script loads it, and its SFT policy."""
    from transformers import AutoModelForCausalLM

    toy.build_guess()
    args = grpo_multiturn.Args()
    task = environments.load_env_task(args.data, args.env, 64, None, 0, evaluate=True)
    return task, AutoModelForCausalLM.from_pretrained(toy.GUESS_POLICY).eval()


def played(task, policy, rows: int, k: int, one_rank_group, **flags):
    """The default run's first batch: `rows` rows, k episodes each, as sample_round plays them."""
    import data

    args = grpo_multiturn.Args(num_samples=k)
    for name, value in flags.items():
        setattr(args.env, name, value)
    sampler = data.PromptSampler(len(task.train_rows), rows, 0, 1, args.run.seed)
    return grpo_multiturn.sample_round(policy, task, sampler, args), args


def test_the_environments_tokens_never_reach_the_loss(guess_task, one_rank_group):
    """Whatever log-probs the environment's tokens get, every loss type's loss and gradient are the same, and the
    gradient there is 0; the mask is exactly the policy's tokens: each turn's guess and its stop token."""
    task, policy = guess_task
    episodes, args = played(task, policy, 4, 4, one_rank_group)
    real = common.response_mask(episodes.lengths, episodes.responses.shape[1])
    environment_tokens = real & ~episodes.mask
    assert environment_tokens.any() and episodes.mask.any()
    # the policy's tokens are its guesses and stop tokens; the environment's its messages
    eos, words = task.tokenizer.eos_token_id, task.tokenizer.convert_ids_to_tokens
    for row in range(len(episodes.responses)):
        policy_words = words(episodes.responses[row][episodes.mask[row]].tolist())
        assert all(w.isdigit() or w == toy.EOS for w in policy_words), policy_words
        assert words(episodes.responses[row][environment_tokens[row]].tolist()) == \
            [w for w in words(episodes.responses[row][:episodes.lengths[row]].tolist())
             if w in ("higher", "lower", "invalid", ":")]
    stops = ((episodes.responses == eos) & episodes.mask).sum(dim=1)
    assert torch.equal(stops[episodes.contains_eos], episodes.turns[episodes.contains_eos].long())  # one per turn
    logprobs = common.rollout_logprobs(policy, episodes, args.generation, args.generation.top_p)  # (N, R)
    advantages = torch.linspace(-1, 1, len(logprobs))
    for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo"):
        args.loss_type, args.epsilon_high = loss_type, 5.0 if loss_type == "cispo" else None
        results = []
        for shift in (0.0, 3.0):
            new = (logprobs + shift * environment_tokens).requires_grad_()  # the environment's tokens moved
            old = logprobs - 0.1 * episodes.mask  # ratios of 1.1 on the policy's tokens
            loss, clipfrac, _ = grpo_multiturn.policy_loss(new, old, advantages, episodes.mask.float(), args, 50.0,
                                                           args.env.max_episode_tokens)
            loss.backward()
            results.append((loss.item(), clipfrac, new.grad))
        (loss_a, clip_a, grad_a), (loss_b, clip_b, grad_b) = results
        assert loss_a == loss_b and clip_a == clip_b and torch.equal(grad_a, grad_b), loss_type
        assert (grad_a[environment_tokens] == 0).all() and (grad_a[episodes.mask] != 0).any(), loss_type


def test_trained_ids_are_the_sampled_ids_even_where_the_text_would_tokenize_otherwise():
    """Token in, token out: a turn whose sampled ids are not how the tokenizer would write its text (byte-level BPE:
    " c" "at" rather than " cat") is kept as sampled, and each message is appended as the chat template's tokens
    around it."""
    from own_inputs import CHAT_TEMPLATE

    tokenizer = byte_level_bpe_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    stop, before, after, _ = environments.template_around_message(tokenizer, [tokenizer.eos_token_id], "bpe", [])
    assert stop == tokenizer.eos_token_id
    assert tokenizer.decode(before) == " user : " and tokenizer.decode(after) == " assistant : "
    task = environments.EnvTask(tokenizer=tokenizer, eos_ids=[tokenizer.eos_token_id], env_class=None, env_name="e",
                                train_rows=None, eval_rows=None, chat_template=True, end_of_turn_id=stop,
                                before_message=before, after_message=after)
    canonical = tokenizer(" the cat sat", add_special_tokens=False)["input_ids"]
    spelled = [token for word in (" the", " c", "at", " sat") for token in tokenizer(word)["input_ids"]]
    assert tokenizer.decode(spelled) == " the cat sat" and spelled != canonical  # the text would re-tokenize
    episode = environments.Episode(env=None, number=0, where="e", prompt_ids=task.first_message_ids("hello"))
    episode.add_turn(environments.Turn(spelled + [stop], True), ("dog ?", 0.5, False), task, 3, 100)
    # ran out of tokens: a stop is added
    episode.add_turn(environments.Turn(spelled[:2], False), ("mat", 0.25, False), task, 3, 100)
    message = tokenizer(" dog ?", add_special_tokens=False)["input_ids"]
    assert episode.ids == [*spelled, stop, *before, *tokenizer("dog ?")["input_ids"], *after,
                           *spelled[:2], stop, *before, *tokenizer("mat")["input_ids"], *after]
    assert message  # (a message is tokenized on its own, between the template's tokens)
    batch = environments.collate([episode], tokenizer.pad_token_id, "cpu")
    assert batch.responses[0, :len(episode.ids)].tolist() == episode.ids
    assert batch.mask[0].tolist()[:len(episode.ids)] == episode.is_action
    assert sum(episode.is_action) == len(spelled) + 1 + 2  # the added stop token is the environment's
    assert episode.missed_stop and episode.episode_return == 0.75 and episode.turns == 2


def test_an_episode_ends_at_done_max_turns_or_the_context_limit():
    tokenizer = toy.make_tokenizer(toy.GUESS_WORDS)
    task = environments.EnvTask(tokenizer=tokenizer, eos_ids=[tokenizer.eos_token_id], env_class=None, env_name="e",
                                train_rows=None, eval_rows=None, chat_template=False,
                                end_of_turn_id=tokenizer.eos_token_id, before_message=[], after_message=[])
    guess = tokenizer("7 <eos>")["input_ids"]

    def episode_after(replies, max_turns=4, max_tokens=33):  # a first message of 1 token
        episode = environments.Episode(env=None, number=0, where="e", prompt_ids=[1])
        for reply in replies:
            episode.add_turn(environments.Turn(guess, True), reply, task, max_turns, max_tokens)
        return episode

    done = episode_after([("higher :", 0.0, False), (None, 1.0, True)])
    assert done.ended and not done.truncated and len(done.ids) == 6 and done.episode_return == 1.0
    out_of_turns = episode_after([("higher :", 0.0, False)] * 2, max_turns=2)
    assert out_of_turns.ended and out_of_turns.truncated and len(out_of_turns.ids) == 6  # no last message
    # 2 + 2 tokens, then a message that would fill the context up: truncated, the message not appended
    out_of_context = episode_after([("higher :", 0.0, False)] * 2, max_tokens=9)
    assert out_of_context.ended and out_of_context.truncated and len(out_of_context.ids) == 6
    assert episode_after([("higher :", 0.0, False)], max_tokens=9).budget(4, 9) == 4
    assert episode_after([("higher :", 0.0, False)], max_tokens=9).budget(4, 7) == 2  # what is left of the context
    assert out_of_context.turns == 2


def test_each_episodes_values_and_counts_reach_the_trainer_by_name(one_rank_group):
    """Every value of an episode a batch carries (Episodes.PER_EPISODE) and every count (environments.EpisodeCounts,
    iterated by name: a new count is its field, where it counts and its metric) crosses from the engine to a rank's
    share of the batch as it was counted: collate, as_arrays, Batch.rows, as_tensors, Episodes.from_batch; and
    rollout_metrics averages each count per episode: rollout/* over the groups kept (not the second, whose episode 3
    failed), env/* over every episode."""
    import vllm_generator

    names = environments.EpisodeCounts.names()
    episodes = [environments.Episode(env=None, number=i, where="", prompt_ids=[1, 2 + i], ids=[3, 4, 5][:1 + i % 3],
                                     is_action=[True, False, True][:1 + i % 3], episode_return=0.5 * i,
                                     truncated=i == 2, failed=i == 3, actions=[None] * (i + 1),
                                     counts=environments.EpisodeCounts(**{name: 10 * i + j for j, name in
                                                                          enumerate(names)}))
                for i in range(4)]
    played = environments.collate(episodes, 0, "cpu")
    batch = vllm_generator.Batch(update=1, prompt_indices=[7, 8], **played.as_arrays())
    share = environments.Episodes.from_batch(batch.rows(2, 4, group_size=2).as_tensors(), 0, "cpu")  # episodes 2, 3
    for name in names:
        assert getattr(share.counts, name).tolist() == [10.0 * i + names.index(name) for i in (2, 3)], name
    for name in environments.Episodes.PER_EPISODE:
        assert torch.equal(getattr(share, name), getattr(played, name)[2:4]), name
    assert share.query_ids.tolist() == [[1, 4], [1, 5]] and share.responses.tolist() == played.responses[2:].tolist()
    metrics = environments.rollout_metrics(played, k=2)
    assert (metrics["rollout/tool_calls_mean"], metrics["rollout/tool_errors_mean"], metrics["env/failed_steps"],
            metrics["env/timeouts"]) == (5.0, 6.0, 17.0, 18.0)
    assert (metrics["rollout/turns_mean"], metrics["rollout/dropped_groups"]) == (1.5, 0.5)


def test_a_group_is_k_episodes_from_one_initial_state(guess_task, one_rank_group):
    """k adjacent episodes share a row and a reset seed, the groups' seeds differ, and they depend on the run's seed
    and the batch only: a resumed run replays the same episodes."""
    import envs

    task, policy = guess_task
    task = dataclasses.replace(task, env_class=envs.RecordsResets)
    batches = []
    for _ in range(2):
        envs.RecordsResets.resets.clear()
        episodes, _ = played(task, policy, 4, 3, one_rank_group)
        batches.append((list(envs.RecordsResets.resets), episodes))
    (resets, episodes), (replayed, replayed_episodes) = batches
    groups = [resets[i:i + 3] for i in range(0, 12, 3)]
    assert all(len(set(group)) == 1 for group in groups)  # one row, one seed
    assert len({seed for (_, seed), *_ in groups}) == 4
    assert resets == replayed and torch.equal(episodes.responses, replayed_episodes.responses)


def test_the_steps_of_different_episodes_run_at_once(guess_task, one_rank_group):
    """A slow environment (0.2 s a step) does not make a turn of 16 episodes take 16 steps' time: every episode still
    playing steps at once."""
    import envs

    task, policy = guess_task
    envs.CountsConcurrentSteps.most = 0
    episodes, _ = played(dataclasses.replace(task, env_class=envs.CountsConcurrentSteps), policy, 4, 4, one_rank_group)
    assert envs.CountsConcurrentSteps.most == 16  # the first turn: none has ended yet


@pytest.mark.parametrize(("env", "message"), [
    ("RaisesInReset", "episode 0 (seed {seed}): reset raised ValueError: no such level"),
    ("RaisesInStep", "episode 0 (seed {seed}): step raised RuntimeError: the tool crashed"),
    ("HangsInStep", "episode 0 (seed {seed}): step did not return within --env_timeout 0.5 s"),
    ("ResetReturnsNumber", "episode 0 (seed {seed}): reset returned int 7; it returns the first message, a str (or "
                           "a list of messages)"),
    ("StepReturnsText", "episode 0 (seed {seed}): step returned str 'higher'; step returns a tuple (next message: "
                        "str, list of messages or None, reward: float, done: bool)"),
    ("RewardIsText", "episode 0 (seed {seed}): step returned reward='1'; the reward must be a finite number"),
    ("RewardIsNan", "episode 0 (seed {seed}): step returned reward=nan; the reward must be a finite number"),
    ("DoneIsText", "episode 0 (seed {seed}): step returned done='no' (str); done must be a bool"),
    ("NoMessageNotDone", "episode 0 (seed {seed}): step returned message=None with done=False; the next message "
                         "must be a str or a list of messages (None only when done)"),
])
def test_an_environment_that_breaks_the_contract_stops_the_run_on_one_line(guess_task, one_rank_group, env,
                                                                         message):
    """Raising, hanging past --env_timeout, or answering with the wrong types: one line that names the environment,
    the episode and what was wrong."""
    task, policy = guess_task
    env_class = environments.load_env_class(f"tests/envs.py:{env}")
    task = dataclasses.replace(task, env_class=env_class, env_name=f"tests/envs.py:{env}")
    seed = environments.reset_seed(1, 1, 0)
    started = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        played(task, policy, 2, 2, one_rank_group, env_timeout=0.5)
    assert str(stop.value.code) == f"error: --env tests/envs.py:{env}, {message.format(seed=seed)}"
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(("spec", "message"), [
    ("tests/envs.py:NeedsArguments", "--env 'tests/envs.py:NeedsArguments': building one with no arguments raised "
                                     "TypeError"),
    ("tests/envs.py:NoStep", "--env 'tests/envs.py:NoStep' has reset but no step: a TRL-style environment "
                             "(reset(**row), its public methods its tools) needs get_reward() -> float, the episode's "
                             "return; or give it the kit's step(action)"),
    ("tests/envs.py:Missing", "--env 'tests/envs.py:Missing': 'tests/envs.py' has no class 'Missing'"),
    ("toy:chess", "--env 'toy:chess': no embedded environment 'chess'; there are toy:guess_number, "
                  "toy:guess_number_slow"),
])
def test_an_environment_that_cannot_be_built_stops_before_the_run_starts(spec, message):
    with pytest.raises(SystemExit) as stop:
        environments.load_env_class(spec)
    assert str(stop.value.code).startswith(f"error: {message}") and "\n" not in str(stop.value.code)


@pytest.mark.slow
def test_the_default_run_learns_guess_the_number(tmp_path):
    """The default run (40 updates of 32 rows x 4 episodes at 1e-4; evaluated on 64 rows here): greedy episodes go
    from the SFT policy's linear search (0.19 on these rows) to at least +0.3 (measured 0.73; binary search wins
    all); the rollout metrics say what the episodes were."""
    run_script("--output_dir", tmp_path / "run", "--eval_every", "20", "--eval_num_prompts", "64",
               script="grpo_multiturn.py")
    metrics = read_metrics(tmp_path / "run")
    evals = [m["eval/return_mean"] for m in metrics if "eval/return_mean" in m]
    assert len(evals) == 3 and evals[-1] >= evals[0] + 0.3, evals
    train = [m for m in metrics if "rollout/return_mean" in m]
    assert len(train) == 40
    assert all(1 <= m["rollout/turns_mean"] <= toy.GUESS_TURNS and 0 < m["rollout/env_tokens_frac"] < 0.5
               and 0 <= m["rollout/truncated_episodes"] <= 1 for m in train)
    assert train[-1]["rollout/return_mean"] > train[0]["rollout/return_mean"] + 0.2
    assert train[-1]["rollout/turns_mean"] < train[0]["rollout/turns_mean"]  # binary search wins sooner
    assert_trained_policy_saved(tmp_path / "run", toy.GUESS_POLICY)


@pytest.mark.slow
def test_resume_is_exact_through_kills_mid_episode(tmp_path):
    """Killed while an update's episodes are played (before any checkpoint) and while checkpoint 4 is written:
    the resumed run replays the same episodes and ends with the same weights, bit for bit. With a KL penalty to the
    reference policy (its log-probs of the episodes too), truncated episodes left out of the loss, and each turn's
    own advantage (--turn_advantage reward_to_go, discounted: each turn's reward and index replayed too)."""
    args = ["--total_episodes", "192", "--save_every", "2", "--eval_every", "0", "--beta", "0.05",
            "--mask_truncated_completions", "--turn_advantage", "reward_to_go", "--gamma", "0.9"]
    whole, resumed = uninterrupted_and_resumed_runs(
        tmp_path, "grpo_multiturn.py", args,
        ("SIGKILL during update 1, before any checkpoint", "SIGKILL while checkpoint 4 is being written"))
    assert_same_weights_and_metrics(whole, resumed, ["loss/policy_avg", "rollout/return_mean", "rollout/turns_mean",
                                                     "objective/kl"], after_update=2)


@pytest.mark.slow
def test_two_ranks_train_as_one(tmp_path):
    """Two ranks of 16 rows each (the batch's reward statistics over both: --scale_rewards batch) against one rank
    of 32 in two micro-batch rounds: the same episodes (reset and sampling seeds by the row's place in the global
    batch; the environment's secret comes from its reset seed), the same losses, the same weights. With each turn's
    rewards normalised per turn index within its group (--turn_advantage turn_index_norm)."""
    args = ["--total_episodes", "128", "--eval_every", "0", "--scale_rewards", "batch", "--env",
            "tests/envs.py:SecretFromSeed", "--turn_advantage", "turn_index_norm"]
    script = "grpo_multiturn.py"
    run_script(*args, "--gradient_accumulation_steps", "2", "--output_dir", tmp_path / "two", script=script,
               launcher=("deepspeed", "--num_gpus", "2", "--master_port", str(free_port())),
               env={"OMP_NUM_THREADS": "1"})
    run_script(*args, "--gradient_accumulation_steps", "4", "--output_dir", tmp_path / "one", script=script,
               env={"OMP_NUM_THREADS": "1"})
    assert_two_ranks_train_as_one(tmp_path / "two", tmp_path / "one")


@pytest.mark.slow
def test_a_hanging_environment_stops_the_run_and_keeps_the_last_checkpoint(tmp_path):
    """An environment that hangs in the third update (of 2 rows x 4 episodes): the run stops within --env_timeout
    with one line, and the checkpoint of update 2 is whole (the run resumes from it)."""
    result = run_script("--env", "tests/envs.py:HangsLater", "--env_timeout", "3", "--save_every", "1",
                        "--eval_every", "0", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
                        "--output_dir", tmp_path / "run", script="grpo_multiturn.py", check=False, timeout=300)
    last_line = (result.stdout + result.stderr).strip().splitlines()[-1]
    assert result.returncode == 1 and last_line.startswith("error: --env tests/envs.py:HangsLater, episode "), last_line
    assert last_line.endswith("step did not return within --env_timeout 3 s"), last_line
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["update-2"]
    assert not (tmp_path / "run" / "policy").exists()


def test_a_researchers_environment_trains_a_chat_model(tmp_path):
    """tests/envs.py:SaysAnswer on a byte-level BPE Qwen2 model with its chat template and a prompt-only .jsonl: the
    episodes are two turns of chat messages, the run trains and saves the policy."""
    from own_inputs import chat_policy_and_prompts

    policy, prompts = chat_policy_and_prompts(tmp_path)
    run_script("--env", "tests/envs.py:SaysAnswer", "--model_name_or_path", policy, "--chat_template",
               "--dataset_name", prompts, "--response_length", "6", "--max_episode_tokens", "100",
               "--max_turns", "3", "--total_episodes", "64", "--per_device_train_batch_size", "4",
               "--gradient_accumulation_steps", "2", "--eval_every", "4", "--eval_num_prompts", "8",
               "--output_dir", tmp_path / "run", script="grpo_multiturn.py")
    metrics = read_metrics(tmp_path / "run")
    train = [m for m in metrics if "rollout/turns_mean" in m]
    assert len(train) == 8 and all(1 <= m["rollout/turns_mean"] <= 2 for m in train)
    assert all(0 < m["rollout/env_tokens_frac"] < 1 and 0 < m["rollout/return_mean"] < 2 for m in train)
    with open(tmp_path / "run" / "args.json") as f:
        assert json.load(f)["args"]["env"] == "tests/envs.py:SaysAnswer"
    assert_trained_policy_saved(tmp_path / "run", policy)


def test_the_readmes_example_environment_keeps_the_contract(tmp_path, guess_task, one_rank_group):
    """The README's complete example environment, as a researcher would save it: it loads with --env and plays
    episodes to their end on the toy policy (its rows made here)."""
    import datasets

    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## Multi-turn environments"):readme.index("## Your own model and data")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "my_env.py").write_text(code)
    task, policy = guess_task
    env_class = environments.load_env_class(f"{tmp_path}/my_env.py:Countdown")
    rows = datasets.Dataset.from_dict({"target": [3, 5, 8, 12] * 4})
    task = dataclasses.replace(task, env_class=env_class, env_name="my_env.py:Countdown", train_rows=rows)
    episodes, _ = played(task, policy, 4, 2, one_rank_group)
    assert episodes.turns.min() >= 1 and episodes.returns.min() >= -0.1 * toy.GUESS_TURNS


@pytest.mark.slow
def test_bad_input_gives_a_one_line_error_and_leaves_nothing(tmp_path):
    import datasets

    toy.build_guess()
    validation = datasets.load_from_disk(toy.GUESS_DATASET)["validation"]
    datasets.DatasetDict({"train": validation.select([]), "validation": validation}).save_to_disk(tmp_path / "empty")
    cases = [
        (["--env", "toy:chess"], "--env 'toy:chess': no embedded environment 'chess'"),
        (["--env", "tests/envs.py:NoStep"], "--env 'tests/envs.py:NoStep' has reset but no step: a TRL-style "
                                           "environment"),
        (["--env", "tests/envs.py"], "--env 'tests/envs.py' must be path/to/file.py:class or module:class"),
        (["--max_turns", "0"], "--max_turns must be positive, got 0"),
        (["--max_episode_tokens", "0"], "--max_episode_tokens must be positive, got 0"),
        (["--env_timeout", "0"], "--env_timeout must be positive, got 0.0"),
        (["--model_name_or_path", "/nonexistent/model"], "'/nonexistent/model' does not exist"),
        (["--dataset_name", tmp_path / "empty"], "split 'train' is empty"),
        (["--chat_template"], "--chat_template was given but the tokenizer of"),
        (["--total_episodes", "100"], "--total_episodes 100 is not a multiple of the batch size 32"),
        (["--num_samples", "1"], "--num_samples must be at least 2"),
        (["--loss_type", "cispo"], "--loss_type cispo caps the ratio itself at --epsilon_high, which must be above 1"),
        (["--use_peft", "--lora_target_modules", "q_proj", "qkv"], "--lora_target_modules 'qkv' names no layer of"),
        (["--eval_every", "-1"], "--eval_every must be 0 (no evaluation) or positive, got -1"),
        # known only once an environment has sent it: the run stops at its first reset, its checkpoints untouched
        (["--max_episode_tokens", "7"], "episode 0 (seed 1471889417): the first message is 8 tokens, which leaves "
                                        "no room for a turn in --max_episode_tokens 7"),
    ]
    argvs = [[*map(str, flags), "--output_dir", str(tmp_path / f"case{i}")] for i, (flags, _) in enumerate(cases)]
    result = run_script("grpo_multiturn", json.dumps(argvs), script="tests/run_in_one_process.py", timeout=600)
    messages = json.loads(result.stdout.split("RESULTS ")[-1])
    for i, ((flags, expected), message) in enumerate(zip(cases, messages, strict=True)):
        assert message.startswith("error: ") and "\n" not in message and expected in message, (flags, message)
        assert not (tmp_path / f"case{i}").exists() or "first message" in expected, f"{flags} left output behind"


@pytest.mark.slow
def test_mask_truncated_completions_drops_exactly_the_truncated_episodes(tmp_path):
    """tests/envs.py:SaysAnswer ends its episodes at their second turn. With --max_turns 1 every episode is
    truncated: with the flag nothing is left in the loss (0 at every update), without it the same episodes train;
    with --max_turns 3 none is: the flag changes nothing, bit for bit. A mask that dropped the wrong episodes, or
    none, fails one of the two. grpo_multiturn_vllm.py's loss is the same code; the engine's episodes bring their
    truncation to it by name (test_each_episodes_values_and_counts_reach_the_trainer_by_name)."""
    script = "grpo_multiturn.py"
    from own_inputs import chat_policy_and_prompts

    policy, prompts = chat_policy_and_prompts(tmp_path)
    common_flags = ["--env", "tests/envs.py:SaysAnswer", "--model_name_or_path", policy, "--chat_template",
                    "--dataset_name", prompts, "--response_length", "6", "--max_episode_tokens", "100",
                    "--total_episodes", "24", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps",
                    "1", "--eval_every", "0"]
    runs = {(turns, flag): tmp_path / f"turns{turns}{'-masked' if flag else ''}"
            for turns in (1, 3) for flag in (True, False)}
    for (turns, flag), out in runs.items():
        run_script(*common_flags, "--max_turns", turns, *(["--mask_truncated_completions"] if flag else []),
                   "--output_dir", out, script=script)
    train = {run: [m for m in read_metrics(out) if "loss/policy_avg" in m] for run, out in runs.items()}
    assert all(len(metrics) == 6 for metrics in train.values())
    assert all(m["rollout/truncated_episodes"] == 1 for m in train[1, True] + train[1, False])
    # no token in the loss: no ratio (logged as 1, its variance 0) and nothing stale among none
    assert all(m["loss/policy_avg"] == 0 and m["val/ratio"] == 1 and m["val/ratio_var"] == 0
               and m["async/ess"] == 1 for m in train[1, True])
    assert any(m["loss/policy_avg"] != 0 for m in train[1, False])
    assert all(m["rollout/truncated_episodes"] == 0 for m in train[3, True])
    assert_same_weights_and_metrics(runs[3, True], runs[3, False], ["loss/policy_avg"])
