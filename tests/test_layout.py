"""The kit's layout promises: no kit module imports another that imports it back (imports inside functions
included), as the README's map says; no module is over 800 lines; a synchronous script never imports vLLM; the
embedded tasks (the toy package) and the math reward import nothing of the kit; the toy's own answer check
agrees with the math reward's on the arithmetic task; and every link between the docs reaches its file and heading."""

import ast
import functools
import glob
import os
import re
import subprocess
import sys

import pytest
from scripts import ROOT, environment

# the top-level modules and packages (the toy package: its modules count as one module of the kit)
KIT_MODULES = tuple(sorted(name.removesuffix(".py") for name in os.listdir(ROOT) if name.endswith(".py")
                           or os.path.isfile(os.path.join(ROOT, name, "__init__.py"))))


def source_files(module: str) -> list[str]:
    """The file of a top-level module, or the modules of a package."""
    folder = os.path.join(ROOT, module)
    return sorted(glob.glob(os.path.join(folder, "*.py"))) if os.path.isdir(folder) else [f"{folder}.py"]


def kit_imports(module: str) -> set[str]:
    """The kit modules that `module` (any module of a package) imports, at its top or inside a function."""
    names = set()
    for path in source_files(module):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names & set(KIT_MODULES) - {module}


def test_the_imports_go_one_way():
    """No circle: the modules can be ordered so that each imports only modules before it."""
    left = {module: kit_imports(module) for module in KIT_MODULES}
    while left:
        ready = [module for module, imports in left.items() if not imports & set(left)]
        assert ready, f"an import circle among {sorted(left)}"
        for module in ready:
            del left[module]


def test_the_readmes_map_of_imports_is_the_code():
    """The README's table of what each shared module imports of the kit, in an order where each imports only
    modules above it."""
    with open(os.path.join(ROOT, "README.md")) as f:
        rows = re.findall(r"^\| `(\w+)(?:\.py|/)` \| (nothing|[`\w ]+) \| .+ \|$", f.read(), re.M)
    assert rows
    listed = [module for module, _ in rows]
    for position, (module, imports) in enumerate(rows):
        assert set(re.findall(r"`(\w+)`", imports)) == kit_imports(module), module
        assert kit_imports(module) <= set(listed[:position]), module
    scripts = {"online_dpo", "online_dpo_vllm", "ppo", "ppo_vllm", "rloo", "rloo_vllm", "bok", "grpo", "grpo_vllm",
               "grpo_multiturn", "grpo_multiturn_vllm", "sft", "reward_model", "eval_checkpoints"}
    assert {module for module, _ in rows} == set(KIT_MODULES) - scripts


@functools.cache
def github_anchors(path: str) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation but hyphens dropped, spaces as
    hyphens, a repeated heading's with -1, -2, ...; headings inside code blocks are none."""
    with open(path) as f:
        markdown = f.read()
    anchors, seen, in_code = set(), {}, False
    for line in markdown.splitlines():
        in_code ^= line.startswith("```")
        heading = None if in_code else re.match(r"#+ (.*)", line)
        if heading:
            anchor = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
            seen[anchor] = seen.get(anchor, 0) + 1
    return anchors


def test_every_link_between_the_docs_reaches_its_file_and_heading():
    docs = glob.glob(os.path.join(ROOT, "*.md")) + glob.glob(os.path.join(ROOT, "bench", "*.md"))
    links, broken = 0, []
    for doc in docs:
        with open(doc) as f:
            targets = re.findall(r"\]\(([^)\s]+)\)", f.read())
        for target in (t for t in targets if not t.startswith(("http://", "https://"))):
            links += 1
            file, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(doc), file)) if file else doc
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(doc, ROOT)}: {target} (no such file)")
            elif anchor and path.endswith(".md") and anchor not in github_anchors(path):
                broken.append(f"{os.path.relpath(doc, ROOT)}: {target} (no such heading)")
    assert links > 20 and not broken, broken


def test_no_module_is_over_800_lines():
    lengths = {os.path.relpath(path, ROOT): sum(1 for _ in open(path)) for module in KIT_MODULES
               for path in source_files(module)}
    assert lengths and all(path in lengths for path in ("common.py", "toy/builder.py", "toy/tldr.py"))
    assert not {path: length for path, length in lengths.items() if length > 800}


def modules_after_import(*names: str) -> set[str]:
    """The modules a fresh interpreter has loaded after importing `names`."""
    code = f"import sys\nimport {', '.join(names)}\nprint(' '.join(sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environment(), capture_output=True,
                            text=True, check=True)
    return set(result.stdout.split())


@pytest.mark.slow
def test_the_synchronous_scripts_import_no_vllm_code():
    """eval_checkpoints.py only the flags of its --vllm engine (vllm_placement, which imports vLLM to start one)."""
    vllm_modules = {"async_generator", "vllm_generator", "vllm_placement", "weight_transport", "inflight"}
    for scripts, allowed in [(("online_dpo", "ppo", "rloo", "bok", "grpo", "grpo_multiturn", "sft", "reward_model"),
                              set()), (("eval_checkpoints",), {"vllm_placement"})]:
        loaded = modules_after_import(*scripts)
        assert {"common", "data"} <= loaded
        assert not {name for name in loaded if name in vllm_modules - allowed or name.split(".")[0] == "vllm"}


@pytest.mark.slow
def test_the_toy_and_the_math_reward_import_nothing_of_the_kit():
    loaded = modules_after_import("toy", "math_reward")
    assert {"toy", "math_reward"} <= loaded and not set(KIT_MODULES) - {"toy", "math_reward"} & loaded


def test_the_toys_answer_check_agrees_with_the_math_reward():
    import math_reward
    import toy

    cases = [(37, 48, " 7 + 8 = 15 , 3 + 4 + 1 = 8 #### 85"), (37, 48, toy.worked_solution(37, 48, forget_carry=True)),
             (12, 30, toy.worked_solution(12, 30)), (12, 30, "#### 42 #### 7"), (12, 30, "no answer"),
             (99, 99, "#### 1,98"), (99, 99, "####198.0")]
    for a, b, completion in cases:
        assert toy.states_the_sum(completion, a, b) == math_reward.same_final_answer(
            completion, toy.worked_solution(a, b)), (a, b, completion)
    assert [toy.states_the_sum(c, a, b) for a, b, c in cases] == [True, False, True, True, False, True, True]
