"""The command line of every script: its Args from three layers, `--preset NAME` (the file
configs/<script>/NAME.yaml), then `--config FILE` (YAML, or a run's args.json), then the flags given, each
overriding the one before; tyro parses and checks them all, and every error is one line.

A script's Args holds its algorithm's own flags, then groups of the flags several scripts share, each a
dataclass declared in the module that reads it (common.OptimizerArgs, data.DataArgs, ...): `args.beta`,
`args.optimizer.learning_rate`. On the command line, in config files and in args.json every flag keeps its
flat name (--learning_rate); --help lists the algorithm's flags first, then each group under its heading."""

import contextlib
import copy
import dataclasses
import os
import re
import sys

import common
import flag_history

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")  # configs/<script stem>/<preset>.yaml


@dataclasses.dataclass
class ConfigFiles(common.FlagGroup):
    """Configuration files"""

    preset: str | None = None
    """start from configs/<script>/NAME.yaml, a named configuration (the README lists them); flags override it"""
    config: str | None = None
    """a YAML file of flags' values (`learning_rate: 3.0e-6` per line), or a run's args.json to repeat that
    run; applied after --preset (eval_checkpoints.py: after --run_dir's values), and the flags given override it"""


def group(default):
    """An Args field holding a flag group, `default` its values (the group's defaults, and those the script
    changes): `optimizer: common.RLOptimizerArgs = cli.group(common.RLOptimizerArgs(learning_rate=3e-5))`."""
    return dataclasses.field(default_factory=lambda: copy.deepcopy(default))


def groups(args) -> list:
    """`args` and the flag groups it holds (common.FlagGroup)."""
    return [args, *(value for value in vars(args).values() if isinstance(value, common.FlagGroup))]


def flag_values(args) -> dict:
    """Every flag of `args` by its command-line name, its groups' flags included: what args.json records."""
    return {field.name: getattr(holder, field.name) for holder in groups(args) for field in dataclasses.fields(holder)
            if not dataclasses.is_dataclass(getattr(holder, field.name))}


def with_flags(args, **flags):
    """`args`, a script's Args made in code (a bench's runs), with `flags` set by their command-line names."""
    holders = {field.name: holder for holder in groups(args) for field in dataclasses.fields(holder)}
    for name, value in flags.items():
        setattr(holders[name], name, value)
    return args


def flag_names(args_class) -> list[str]:
    """The command-line names of `args_class`'s flags, its groups' flags included."""
    names = []
    for field in dataclasses.fields(args_class):
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
        names += flag_names(type(default)) if dataclasses.is_dataclass(default) else [field.name]
    return names


def presets(args_class) -> dict[str, str]:
    """The named configurations of `args_class`'s script: the YAML files under configs/<its stem>/, by name."""
    stem = os.path.splitext(os.path.basename(sys.modules[args_class.__module__].__file__))[0]
    folder = os.path.join(CONFIGS, stem)
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return {name.removesuffix(".yaml"): os.path.join(folder, name) for name in names if name.endswith(".yaml")}


# what a flag or a config file names as toy:<name>: an artefact of the embedded tasks (toy/, built on first use)
TOY_ARTEFACTS = {f"toy:{name.lower()}": name for name in ("SFT_POLICY", "REWARD_MODEL", "DATASET", "MATH_POLICY",
                                                          "MATH_DATASET", "LARGE_SFT_POLICY", "BASE_POLICY",
                                                          "SFT_DATASET", "PREFERENCE_DATASET", "GUESS_POLICY",
                                                          "GUESS_DATASET", "TOOLS_POLICY", "TOOLS_DATASET",
                                                          "PROBE_POLICY", "PROBE_DATASET", "LAKE_POLICY",
                                                          "LAKE_DATASET", "HOPS_POLICY", "HOPS_DATASET")}


def parse(args_class, run_fields: tuple[str, ...] = ()):
    """Parse the command line into `args_class` with tyro, in three layers: `--preset NAME` (the file
    configs/<script>/NAME.yaml), then `--config FILE`, then every flag given, each overriding the one before
    (config_flags turns a file into flags). `run_fields` (eval_checkpoints.py): with `--run_dir RUN`, these
    fields start from RUN's args.json, under the other layers. A value `toy:<name>` names an artefact of the
    embedded toy tasks (TOY_ARTEFACTS; --env's toy:NAME is an embedded environment)."""
    import argparse
    import io

    import tyro

    import toy

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--preset")
    parser.add_argument("--config")
    parser.add_argument("--run_dir")
    for name in (*flag_history.REPLACED, *flag_history.RENAMED):
        parser.add_argument(f"--{name}")
    given = parser.parse_known_args()[0]
    for name in flag_history.REPLACED:
        flag_history.check_replaced(name, getattr(given, name), "")
    # typed: the new name taught (a file's old name is read as the new one)
    for old, new in flag_history.RENAMED.items():
        if getattr(given, old) is not None:
            common.fail(f"--{old} is now --{new}")
    file_flags, file_preset = config_flags(given.config, args_class) if given.config else ([], None)
    if run_fields and given.run_dir:
        if not os.path.isfile(os.path.join(given.run_dir, "args.json")):
            common.fail(f"--run_dir {given.run_dir!r} has no args.json: give the output directory of a training run")
        file_flags = config_flags(os.path.join(given.run_dir, "args.json"), args_class, run_fields)[0] + file_flags
    chosen, named = given.preset or file_preset, presets(args_class)
    if chosen is not None and chosen not in named:
        common.fail(f"--preset {chosen!r} is not one of this script's presets: {', '.join(named) or 'it has none'}")
    preset_flags = config_flags(named[chosen], args_class)[0] if chosen else []
    summary = " ".join(sys.modules[args_class.__module__].__doc__.split("\n\n")[0].split())
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            # the groups' flags keep their flat names: --learning_rate, not --optimizer.learning_rate
            args = tyro.cli(args_class, use_underscores=True, args=[*preset_flags, *file_flags, *sys.argv[1:]],
                            description=f"{summary}\n\n{common.PREEMPTION_HELP}", config=(tyro.conf.OmitArgPrefixes,))
    except SystemExit as exit:
        if exit.code in (0, None):
            raise
        common.fail(" ".join(re.sub(r"[╭╮╰╯│─]+", " ", errors.getvalue()).split()))  # tyro's boxed message, on one line
    for holder in groups(args):
        for name, value in vars(holder).items():
            if isinstance(value, str) and value.startswith("toy:") and name != "env":  # --env toy:NAME: environments.py
                if value not in TOY_ARTEFACTS:
                    common.fail(f"--{name} {value!r} names no toy artefact; they are {', '.join(TOY_ARTEFACTS)}")
                setattr(holder, name, getattr(toy, TOY_ARTEFACTS[value]))
        if isinstance(holder, common.FlagGroup):  # its checks of its own values, before anything is written
            holder.check()
    return args


def config_flags(path: str, args_class, only: tuple[str, ...] | None = None) -> tuple[list[str], str | None]:
    """A --config file's fields as command-line flags, which tyro then checks as it checks typed ones, and
    the preset it names. The file is YAML (`learning_rate: 3.0e-6` per line) or a run's args.json (its
    "args": `--config OUT/args.json --output_dir NEW` repeats OUT's run); a key that is no field of
    `args_class` stops with a one-line error naming the nearest one. With `only`, the keys of those fields
    are taken and the others skipped."""
    import difflib

    import yaml

    if not os.path.isfile(path):
        common.fail(f"--config {path!r} does not exist")
    try:
        with open(path) as f:
            values = yaml.safe_load(f)  # JSON is YAML too
    except yaml.YAMLError as error:
        common.fail(f"--config {path!r} is neither YAML nor JSON: {' '.join(str(error).split())}")
    recorded_run = isinstance(values, dict) and isinstance(values.get("args"), dict) and "versions" in values
    flags_format = values.pop("flags_format", 1) if isinstance(values, dict) else 1
    if recorded_run:  # a run's args.json
        written = values["args"]
        values = flag_history.in_current_names(written, flags_format)
        if values.get("off_policy_correction") != written.get("off_policy_correction") and (
                os.environ.get("RANK", "0") == "0"):
            print(f"--config {path!r}: written when --off_policy_correction decoupled named what is now pure_is: "
                  "replayed as pure_is")
    elif isinstance(values, dict) and values.get("off_policy_correction") == "decoupled" and flags_format < 2:
        common.fail(f"--config {path!r}: off_policy_correction: decoupled is AReaL's decoupled PPO since "
                    "flags_format 2, and was what is now pure_is before: write pure_is for the earlier objective, "
                    "or add `flags_format: 2` to the file for AReaL's")
    elif isinstance(values, dict):  # a YAML file: its renamed flags (a decoupled that would change stopped above)
        values = flag_history.in_current_names(values, flags_format)
    if not isinstance(values, dict) or not values:
        common.fail(f"--config {path!r} must map Args fields to values (one `name: value` per line)")
    fields = flag_names(args_class)
    flags = []
    for name, value in values.items():
        if only is not None and name not in only:
            continue
        if name in flag_history.REPLACED:  # an older run's or file's flag
            flag_history.check_replaced(name, value, f"--config {path!r}: ")
            continue
        if name not in fields:
            nearest = difflib.get_close_matches(str(name), fields, n=1)
            script = os.path.basename(sys.modules[args_class.__module__].__file__)
            common.fail(f"--config {path!r}: {name!r} is not a flag of {script}"
                        + (f"; did you mean {nearest[0]!r}?" if nearest else ""))
        if name in ("config", "local_rank"):  # a file's own --config, and the launcher's
            continue
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no_{name}")
        elif isinstance(value, list):
            flags += [f"--{name}", *map(str, value)]
        else:
            flags += [f"--{name}", str(value)]
    return flags, values.get("preset")
