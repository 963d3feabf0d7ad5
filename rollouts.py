"""What an engine samples: the two kinds of rollout, each owning its engine side (RolloutSource, the
protocol the trainer's side and the generator process call): SamplePrompts, the single-turn scripts' k completions
of each prompt (with --dynamic_sampling, further rounds scored as the trainer scores them), and SampleEpisodes,
grpo_multiturn_vllm.py's k episodes of each environment row, played in the engine through environments.EpisodeLoop
(turn by turn, or each at its own pace). Each kind says what crosses to the generator process, the engine's context
length, how a batch is sampled and checked (async/logprob_diff), how the engine evaluates a version, and what plays
it in flight (inflight.py). A script builds its source (`SamplePrompts.of`, `SampleEpisodes.of`) and hands it to
async_generator.AsyncGenerator."""

import dataclasses
import functools
import random
import time
from dataclasses import dataclass, field

import numpy
import torch

import common
import data
import environments
import evaluation
import inflight
import vllm_generator
from vllm_generator import Batch, Evaluation, GeneratorJob, RolloutSource


@dataclass
class DynamicSampling:
    """--dynamic_sampling in the generator process: it scores each round as the trainer would, and samples
    more rounds of prompts while too few groups have unequal rewards."""

    score: object  # (reward_model, rollout, prompt_rows, task, update=) -> (N,) rewards: the script's own function
    task: common.Task  # the run's (SamplePrompts.portable leaves out what does not cross processes)
    reward: data.RewardArgs  # the reward model or function it scores with (its own copy, on its device)
    max_rounds: int  # --max_sampling_rounds


@dataclass
class SamplePrompts(RolloutSource):
    """The single-turn scripts' batches: k completions of each of the train split's prompts the sampler draws."""

    prompts: list[list[int]]  # the train split's prompts, as token ids
    max_prompt_length: int
    eval_prompts: list[list[int]] | None = None  # the evaluation split's, where the engine evaluates
    dynamic_sampling: DynamicSampling | None = None  # --dynamic_sampling: how the engine scores each round
    score: object = field(default=None, init=False, repr=False)  # --dynamic_sampling: group_scorer's, made by prepare

    @classmethod
    def of(cls, task: common.Task, data_args: data.DataArgs, generation: common.GenerationArgs, bf16: bool,
           sampler: data.PromptSampler, num_samples: int, eval_args: evaluation.SamplingEvalArgs,
           dynamic_sampling: DynamicSampling | None = None) -> "SamplePrompts":
        """k completions of each of `task`'s train prompts, with `dynamic_sampling` scoring each round as the trainer
        would."""
        return cls(data_args.model_name_or_path, bf16, generation, sampler, num_samples, task.eos_ids,
                   task.tokenizer.pad_token_id, eval_args.eval_temperature, task.train_prompts["input_ids"],
                   data_args.max_prompt_length, None if task.eval_prompts is None else task.eval_prompts["input_ids"],
                   dynamic_sampling)

    def portable(self, evaluates: bool) -> "SamplePrompts":
        """Without the reward function, the gold scorer and, unless the engine evaluates, the evaluation prompts (the
        process loads its own reward function)."""
        dynamic = self.dynamic_sampling and dataclasses.replace(self.dynamic_sampling, task=dataclasses.replace(
            self.dynamic_sampling.task, reward_fn=None, eval_prompts=None, gold_score=None))
        return dataclasses.replace(self, eval_prompts=self.eval_prompts if evaluates else None,
                                   dynamic_sampling=dynamic)

    def max_model_len(self) -> int:
        return self.max_prompt_length + self.generation.response_length

    def prepare(self, job: GeneratorJob, device):
        if self.dynamic_sampling is not None:
            self.score = group_scorer(self, device)

    def sample(self, llm, sampling_policy, indices: list[int], update: int, job: GeneratorJob) -> Batch:
        """k completions of each of the prompts `indices`, seeded by their rows in the global batch (sample_batch);
        with --dynamic_sampling, further rounds while too few groups have unequal rewards (sample_with_signal)."""
        queries = [self.prompts[i] for i in indices for _ in range(self.num_samples)]
        rows = range(job.share[0] * len(queries), (job.share[0] + 1) * len(queries))  # in the global batch
        seeds = vllm_generator.row_seeds(job.seed, update, rows)
        batch = sample_batch(llm, sampling_policy, indices, queries, seeds, update, job)
        return batch if self.score is None else sample_with_signal(job, llm, batch, update, self.score)

    def evaluate(self, llm, sampling_policy, version: int, job: GeneratorJob) -> Evaluation:
        """The near-greedy and the sampled completions of every evaluation prompt, seeded as eval_checkpoints.py
        --vllm seeds them (evaluation.engine_seeds), and the sampled ones' log-probs (for the evaluation's KL)."""
        greedy, sampled = vllm_generator.evaluation_completions(llm, self.eval_prompts, job.seed, version,
                                                                self.generation, self.eval_temperature, self.eos_ids,
                                                                self.pad_token_id)
        device, generation = sampling_policy.device, self.generation
        query_ids, query_mask = common.left_pad(self.eval_prompts, self.pad_token_id, device)
        sampled, lengths, _ = common.truncate_after_eos(sampled.to(device), self.eos_ids, self.pad_token_id)
        logprobs = common.in_chunks(
            functools.partial(common.response_logprobs, sampling_policy, temperature=generation.temperature,
                              top_p=generation.top_p),
            generation.local_rollout_forward_batch_size, query_ids, query_mask, sampled, lengths)
        return Evaluation(version, (greedy.numpy(), sampled.cpu().numpy(), logprobs.cpu().numpy()))

    def logprob_diff(self, sampling_policy, batch: Batch, rows: list[int]) -> float:
        device, generation = sampling_policy.device, self.generation
        query_ids, query_mask = common.left_pad([batch.queries[row] for row in rows], self.pad_token_id, device)
        responses = torch.as_tensor(batch.responses[rows]).to(device)  # (rows, R)
        _, lengths, _ = common.truncate_after_eos(responses, self.eos_ids, self.pad_token_id)
        trainer_logprobs = common.in_chunks(
            functools.partial(common.response_logprobs, sampling_policy, temperature=generation.temperature,
                              top_p=generation.top_p),
            generation.local_rollout_forward_batch_size, query_ids, query_mask, responses, lengths)
        mask = common.response_mask(lengths, generation.response_length)
        return common.masked_mean((torch.as_tensor(batch.logprobs[rows]).to(device) - trainer_logprobs).abs(), mask)

    def in_flight(self, job: GeneratorJob, llm, receiver, sampling_policy, one_to_one):
        return inflight.InflightCompletions(job, llm, receiver, sampling_policy, one_to_one)


@dataclass
class SampleEpisodes(RolloutSource):
    """grpo_multiturn_vllm.py's batches: k episodes of each of an environment task's rows the sampler draws, from
    the row's reset seed, played in the engine through environments.EpisodeLoop: turn by turn (every episode's next
    turn waits for the turn's slowest step) or, `continuous`, each episode at its own pace (play_continuously)."""

    task: environments.EnvTask  # without its environment class across processes: loop loads it again there
    env: environments.EnvArgs
    continuous: bool  # --continuous_episodes

    @classmethod
    def of(cls, task: environments.EnvTask, env: environments.EnvArgs, continuous: bool, data_args: data.DataArgs,
           generation: common.GenerationArgs, bf16: bool, sampler: data.PromptSampler, num_samples: int,
           eval_args: evaluation.SamplingEvalArgs) -> "SampleEpisodes":
        """k episodes of each of `task`'s train rows, turn by turn or each at its own pace (`continuous`)."""
        return cls(data_args.model_name_or_path, bf16, generation, sampler, num_samples, task.eos_ids,
                   task.tokenizer.pad_token_id, eval_args.eval_temperature, task, env, continuous)

    def portable(self, evaluates: bool) -> "SampleEpisodes":
        """Without the environment class (loaded again there) and, unless the engine evaluates, the evaluation rows
        (as {column: values} where it does)."""
        return dataclasses.replace(self, task=dataclasses.replace(
            self.task, env_class=None, eval_rows=self.task.eval_rows[:] if evaluates else None))

    def max_model_len(self) -> int:
        return self.env.max_episode_tokens

    def loop(self) -> environments.EpisodeLoop:
        """An episode loop in the generator process, the environment class loaded there."""
        task = dataclasses.replace(self.task, env_class=environments.load_env_class(self.env.env))
        return environments.EpisodeLoop(task, self.env)

    def sample(self, llm, sampling_policy, indices: list[int], update: int, job: GeneratorJob) -> Batch:
        """k episodes of each of this engine's rows `indices` of the global batch, every turn seeded by (seed, update,
        the episode's row in the global batch, turn); on checked batches (vllm_generator.check_logprobs)
        async/logprob_diff over the policy's tokens of the first --logprob_check_rows episodes."""
        loop, k, generation = self.loop(), self.num_samples, self.generation
        first_prompt = job.share[0] * len(indices)  # this engine's rows in the global batch
        seeds = [environments.reset_seed(job.seed, self.sampler.position, first_prompt + i)
                 for i in range(len(indices))]
        t0 = time.time()
        episodes = loop.start(loop.task.train_rows[indices], seeds, k, first_prompt * k)

        def turn_seed(episode: environments.Episode) -> int:
            return random.Random(f"{job.seed}/{update}/{episode.number}/{episode.turns}").getrandbits(63)

        if self.continuous:
            play_continuously(llm, loop, episodes, generation, self.eos_ids, turn_seed)
        else:
            loop.play_turn_by_turn(episodes, self.engine_turns(llm, generation, turn_seed))
        batch = Batch(update=update, prompt_indices=indices, metrics={"time/generate": time.time() - t0},
                      **environments.collate(episodes, self.pad_token_id, "cpu").as_arrays())
        vllm_generator.check_logprobs(job, sampling_policy, batch, update, list(range(len(batch.queries))))
        return batch

    def engine_turns(self, llm, generation: common.GenerationArgs, turn_seed):
        """EpisodeLoop.play_turn_by_turn's sample_turn in the engine: a turn of each episode still playing, each
        seeded by turn_seed(episode)."""

        def engine_turn(episodes: list[environments.Episode], turn: int) -> list:
            playing = [episode for episode in episodes if not episode.ended]
            sampled = vllm_generator.vllm_sample(
                llm, [e.prompt_ids + e.ids for e in playing], [turn_seed(e) for e in playing], generation,
                self.eos_ids, [e.budget(generation.response_length, self.env.max_episode_tokens) for e in playing])
            turns = {e.number: environments.Turn.sampled(ids, self.eos_ids, logprobs)
                     for e, (ids, logprobs) in zip(playing, sampled)}
            return [turns.get(episode.number) for episode in episodes]

        return engine_turn

    def evaluate(self, llm, sampling_policy, version: int, job: GeneratorJob) -> Evaluation:
        """grpo_multiturn_vllm.py's `evaluate`, played here: one near-greedy episode (--eval_temperature) of each
        evaluation row from the reset seed the trainer's evaluation gives it, turn by turn; eval/return_mean,
        eval/turns_mean, eval/truncated_episodes."""
        loop, rows = self.loop(), self.task.eval_rows
        count = len(next(iter(rows.values())))
        seeds = [environments.reset_seed(job.seed, -1, i) for i in range(count)]
        episodes = loop.start(rows, seeds, 1)
        near_greedy = dataclasses.replace(self.generation, temperature=self.eval_temperature, top_p=1.0)

        def turn_seed(episode: environments.Episode) -> int:
            return random.Random(f"{job.seed}/eval/{version}/{episode.number}/{episode.turns}").getrandbits(63)

        loop.play_turn_by_turn(episodes, self.engine_turns(llm, near_greedy, turn_seed))
        played = environments.collate(episodes, self.pad_token_id, "cpu")
        return Evaluation(version, metrics={"eval/return_mean": played.returns.float().mean().item(),
                                            "eval/turns_mean": played.turns.float().mean().item(),
                                            "eval/truncated_episodes": played.truncated.float().mean().item()})

    def logprob_diff(self, sampling_policy, batch: Batch, rows: list[int]) -> float:
        episodes = environments.Episodes.from_batch(batch.as_tensors(), self.pad_token_id, "cpu")
        device = sampling_policy.device
        trainer_logprobs = common.response_logprobs(  # (rows, R)
            sampling_policy, episodes.query_ids[rows].to(device), episodes.query_mask[rows].to(device),
            episodes.responses[rows].to(device), episodes.lengths[rows].to(device), self.generation.temperature,
            self.generation.top_p)
        difference = (episodes.engine_logprobs[rows].to(device) - trainer_logprobs).abs()
        return common.masked_mean(difference, episodes.action_mask[rows].to(device))

    def in_flight(self, job: GeneratorJob, llm, receiver, sampling_policy, one_to_one):
        return inflight.InflightEpisodes(job, llm, receiver, sampling_policy, one_to_one)


def play_continuously(llm, loop: environments.EpisodeLoop, episodes: list[environments.Episode],
                      generation: common.GenerationArgs, eos_ids: list[int], turn_seed):
    """`episodes` played to their end in the engine, each at its own pace (--continuous_episodes): an episode's next
    turn goes into the engine as soon as its environment's step returns, and its step starts as soon as its turn is
    sampled, while the engine samples the other episodes' turns. turn_seed(episode): the seed of its next turn."""
    from vllm.inputs import TokensPrompt

    engine, by_number = llm.llm_engine, {episode.number: episode for episode in episodes}
    max_episode_tokens = loop.env_args.max_episode_tokens

    def next_turn(episode: environments.Episode):
        params = vllm_generator.sampling_params(generation, eos_ids, turn_seed(episode),
                                 episode.budget(generation.response_length, max_episode_tokens))
        engine.add_request(f"{episode.number}/{episode.turns}",
                           TokensPrompt(prompt_token_ids=episode.prompt_ids + episode.ids), params)

    for episode in episodes:
        next_turn(episode)
    while engine.has_unfinished_requests() or loop.running:
        for output in engine.step() if engine.has_unfinished_requests() else []:
            if output.finished:  # a turn sampled: its environment steps on it
                episode, completion = by_number[int(output.request_id.split("/")[0])], output.outputs[0]
                loop.take_turn(episode, environments.Turn.sampled(list(completion.token_ids), eos_ids,
                                                                  list(completion.logprobs.logprobs)))
        for episode in loop.replies(wait=0.0 if engine.has_unfinished_requests() else 0.005):
            if not episode.ended:
                next_turn(episode)


@torch.no_grad()
def sample_batch(llm, sampling_policy, prompt_indices: list[int], queries: list[list[int]], seeds: list[int],
                 update: int, job: GeneratorJob) -> Batch:
    """One completion per row of `queries` (those of the groups of `prompt_indices`) from the engine, seeded by
    `seeds` (vllm_generator.row_seeds), and its engine's metrics: the time it took and, where checked,
    async/logprob_diff (vllm_generator.check_logprobs). Its arrays are numpy (Batch)."""
    source, t0 = job.source, time.time()
    responses, logprobs = vllm_generator.vllm_generate(llm, queries, seeds, source.generation, source.eos_ids,
                                        source.pad_token_id)  # (N, R)
    batch = Batch(update=update, prompt_indices=prompt_indices, queries=queries, responses=responses.numpy(),
                  logprobs=logprobs.numpy(), metrics={"time/generate": time.time() - t0})
    vllm_generator.check_logprobs(job, sampling_policy, batch, update, list(range(len(queries))))
    return batch


def group_scorer(source: SamplePrompts, device):
    """--dynamic_sampling in the generator process: a function (batch, update) -> (N,) rewards of the batch's
    rows, as the trainer computes them (the script's score function), with the run's reward model (a copy on
    `device`) or --reward_fn."""
    dynamic = source.dynamic_sampling
    reward = dynamic.reward
    reward_fn = data.load_python_object(reward.reward_fn, "--reward_fn", "function") if reward.reward_fn else None
    task = dataclasses.replace(dynamic.task, reward_fn=reward_fn)
    reward_model = None
    if not reward.reward_fn:
        dtype = torch.bfloat16 if source.bf16 else torch.float32
        reward_model = data.load_reward_model(reward.reward_model_path, dtype).to(device).eval()

    @torch.no_grad()
    def score(batch: Batch, update: int) -> torch.Tensor:
        query_ids, query_mask = common.left_pad(batch.queries, source.pad_token_id, device)
        responses = torch.from_numpy(batch.responses).to(device)
        rollout = common.truncate_rollout(query_ids, query_mask, responses, task)
        rows = task.train_prompts[batch.prompt_indices]
        return dynamic.score(reward_model, rollout, rows, task, update=update).cpu()

    return score


def sample_with_signal(job: GeneratorJob, llm, batch: Batch, update: int, score) -> Batch:
    """--dynamic_sampling in this engine (common.fill_with_signal): `batch` is the first round; further rounds are
    this engine's share of the sampler's next global batches, sampled with the same weights. The batch is then the
    groups chosen, with their rewards (`scores`) and dynamic_sampling/* in its metrics."""
    source = job.source
    k, t0, sampled = source.num_samples, time.time(), [batch]

    def next_round() -> tuple[Batch, torch.Tensor]:
        indices = vllm_generator.engine_share(source.sampler.next_indices(), job.share)
        queries = [source.prompts[i] for i in indices for _ in range(k)]
        rows = range(job.share[0] * len(queries), (job.share[0] + 1) * len(queries))  # in the global batch
        seeds = vllm_generator.row_seeds(job.seed, update, rows, len(sampled))
        responses, logprobs = vllm_generator.vllm_generate(llm, queries, seeds, source.generation, source.eos_ids,
                                                           source.pad_token_id)
        sampled.append(Batch(update, indices, queries, responses.numpy(), logprobs.numpy()))
        return sampled[-1], score(sampled[-1], update)

    rounds, groups, metrics = common.fill_with_signal((batch, score(batch, update)), next_round, k,
                                                      len(batch.prompt_indices), source.dynamic_sampling.max_rounds)
    groups = groups.tolist()
    rows = [group * k + sample for group in groups for sample in range(k)]
    prompt_indices = [index for round_batch, _ in rounds for index in round_batch.prompt_indices]
    queries = [query for round_batch, _ in rounds for query in round_batch.queries]
    every = lambda name: numpy.concatenate([getattr(round_, name) for round_, _ in rounds])[rows]  # noqa: E731
    return dataclasses.replace(
        batch, prompt_indices=[prompt_indices[g] for g in groups], queries=[queries[r] for r in rows],
        responses=every("responses"), logprobs=every("logprobs"),
        scores=torch.cat([scores for _, scores in rounds])[rows].numpy(),
        metrics={**batch.metrics, **metrics, "time/dynamic_sampling": time.time() - t0})  # scoring, further rounds
