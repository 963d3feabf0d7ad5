"""How the kit's flags changed, so that a file written before (a YAML config, an older run's args.json) still means
what it meant: flags that others replaced, flags renamed, and the format that says which meaning a file's values
have. cli.py reads files through it; outputs.py records the format each run writes."""

import common

# flags that others replaced: the one-line pointer to what replaces them (given the old value)
REPLACED = {"decoupled_weight_cap": "--off_policy_correction pure_is --is_cap {value}"}

# flags renamed, their meaning kept (old name: new name): a file, an older run's args.json, may say the old one.
# is_level sat beside GRPO's --importance_sampling_level, the level of GSPO's ratio, not of the correction's weights
RENAMED = {"is_level": "correction_level"}


# What the flags in a file mean: args.json records it (flags_format), a YAML file may say it (`flags_format: 2`).
# Format 2: --off_policy_correction decoupled is AReaL's decoupled PPO; before (1), it named what is now pure_is.
FLAGS_FORMAT = 2


def in_current_names(values: dict, flags_format: int) -> dict:
    """`values` (a file's flags by name: an args.json's, a YAML file's) written in format `flags_format`, under
    today's names (RENAMED) and in today's meaning: a new dict."""
    current = {RENAMED.get(name, name): value for name, value in values.items()}
    if flags_format < 2 and current.get("off_policy_correction") == "decoupled":
        current["off_policy_correction"] = "pure_is"
    return current


def check_replaced(name: str, value, where: str):
    """Stop with a pointer to the new flags when `name` (given a value) was replaced; None: the old default."""
    if name in REPLACED and value is not None:
        common.fail(f"{where}--{name} is now {REPLACED[name].format(value=value)}")
