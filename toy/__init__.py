"""The embedded tasks: small worlds trained offline on CPU, each built once, deterministically, on first use, and
saved in Hugging Face formats (the training scripts load them with `from_pretrained` / `load_from_disk`).

    tldr.py        the default task: a tiny synthetic world shaped like TL;DR summarisation, its gold judge,
                   SFT policy and reward model (build)
    large.py       a 7.7x larger SFT policy of that world, for questions about scale (build_large)
    pipeline.py    what sft.py and reward_model.py start from on that world (build_pipeline)
    arithmetic.py  the arithmetic task with GSM8k-style answers, `--preset toy-math` (build_math)
    guess.py       the guess-the-number environment of the multi-turn scripts (build_guess)
    probe.py       guess-the-number where the policy decides when to answer, `--env toy:probe_answer` and
                   `toy:probe_answer_shaped` (build_probe)
    lake.py        FrozenLake's 4x4 grid world, `--env toy:lake` and `toy:lake_slippery` (build_lake)
    hops.py        multi-hop questions over a small fact base, answered one hop at a time by search, `--env toy:hops`
                   (build_hops)
    play.py        what those three builds play their episodes with
    tools.py       the addition task with a tool `add`, `--env toy:add_with_tool` (build_tools)
    builder.py     what they share: the cache folders, one build at a time, tokenizers, shapes, training

Each task is cached in a folder named by the hash of its own code (its module, builder.py and the module it builds
on), so an edited task builds again and the others stay built; ASYNC_RLHF_TOY_DIR moves them all (the TL;DR-like
world there, the others beside it). `python -m toy` builds the default task (if needed) and prints its numbers;
`python -m toy large` does the same for the larger SFT policy. The package imports no module of the kit.
"""

from toy.arithmetic import (
    CARRY_SHARE,
    MATH_DATASET,
    MATH_DIR,
    MATH_POLICY,
    build_math,
    make_math_tokenizer,
    math_splits,
    states_the_sum,
    worked_solution,
)
from toy.builder import EOS, LARGE_SHAPE, SMALL_SHAPE, make_tokenizer
from toy.guess import (
    GUESS_DATASET,
    GUESS_DIR,
    GUESS_POLICY,
    GUESS_RANGE,
    GUESS_TURNS,
    GUESS_WORDS,
    GuessTheNumber,
    SlowGuessTheNumber,
    build_guess,
)
from toy.hops import HOPS_DATASET, HOPS_DIR, HOPS_POLICY, HOPS_TOKENS, HOPS_TURNS, MultiHop, build_hops
from toy.lake import (
    LAKE_DATASET,
    LAKE_DIR,
    LAKE_POLICY,
    LAKE_TURNS,
    FrozenLake,
    FrozenLakeSlippery,
    build_lake,
)
from toy.large import LARGE_DIR, LARGE_SFT_POLICY, build_large
from toy.pipeline import BASE_POLICY, PIPELINE_DIR, PREFERENCE_DATASET, SFT_DATASET, build_pipeline
from toy.probe import (
    PROBE_DATASET,
    PROBE_DIR,
    PROBE_POLICY,
    PROBE_TURNS,
    ProbeAnswer,
    ProbeAnswerShaped,
    build_probe,
)
from toy.tldr import DATASET, REWARD_MODEL, SFT_POLICY, TOY_DIR, WORDS, build, gold_score, model_config, parse_query
from toy.tools import (
    TOOLS_DATASET,
    TOOLS_DIR,
    TOOLS_POLICY,
    TOOLS_TEMPLATE,
    TOOLS_WORDS,
    AddWithTool,
    build_tools,
    tool_call_text,
)

ENVIRONMENTS = {"guess_number": GuessTheNumber, "guess_number_slow": SlowGuessTheNumber,
                "add_with_tool": AddWithTool, "probe_answer": ProbeAnswer, "probe_answer_shaped": ProbeAnswerShaped,
                "lake": FrozenLake, "lake_slippery": FrozenLakeSlippery, "hops": MultiHop}  # --env toy:NAME
