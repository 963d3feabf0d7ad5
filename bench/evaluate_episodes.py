"""The evaluated return of every policy snapshot of a multi-turn run (policies/update-N, and the SFT policy as update
0), played as grpo_multiturn.py's evaluation plays them (grpo_multiturn.evaluate: one near-greedy episode of each
validation row, reset seeds of their own), with no --env_latency: after the run, outside its clock. Writes
RUN_DIR/evaluations.json (update -> return) once every snapshot is done. bench/agent_speedup.py calls it.

    python bench/evaluate_episodes.py RUN_DIR SEED ROWS [the run's task flags: --env ... --model_name_or_path ...]
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(run_dir: str, seed: str, rows: str, task_flags: list[str]):
    import torch
    from transformers import AutoModelForCausalLM

    import cli
    import common
    import environments
    import grpo_multiturn

    sys.argv = [grpo_multiturn.__file__, *task_flags, "--seed", seed, "--eval_num_prompts", rows, "--eval_every", "1",
                "--output_dir", os.path.join(run_dir, "unused")]
    args = cli.parse(grpo_multiturn.Args)
    args.env.env_latency = 0.0  # the return does not depend on it, and no clock runs
    common.init_distributed()
    common.seed_everything(args.run.seed, args.run.torch_deterministic)
    task = environments.load_env_task(args.data, args.env, args.evaluation.eval_num_prompts, args.lora, 0,
                                      evaluate=True, response_length=args.generation.response_length)
    folder = os.path.join(run_dir, "policies")
    snapshots = {0: args.data.model_name_or_path,
                 **{int(name.removeprefix("update-")): os.path.join(folder, name) for name in os.listdir(folder)}}
    returns = {}
    for update, path in sorted(snapshots.items()):
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        returns[update] = grpo_multiturn.evaluate(policy, task, args, update)["eval/return_mean"]
        print(f"update {update}: return {returns[update]:.3f}", flush=True)
    with open(os.path.join(run_dir, "evaluations.json"), "w") as f:
        json.dump(returns, f)


if __name__ == "__main__":
    main(*sys.argv[1:4], sys.argv[4:])
