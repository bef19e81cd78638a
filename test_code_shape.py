"""The shape of the code, as the README promises it: its equation map points at lines of grpo.py, grpo.py imports
torch alone, and train() is labelled with Algorithm 1's lines in order. Files are read relative to the repository
root (HERE, conftest.py's directory).
"""

import os
import re

from conftest import HERE


def source(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


def test_readme_equation_map_points_at_lines_of_grpo_py():
    readme, code = source("README.md"), source("grpo.py")
    # The table after the section's first paragraph.
    table = readme.split("## Equation to code")[1].split("\n\n")[2]
    strings = [row.rsplit("|", 2)[1].strip().strip("`") for row in table.splitlines()[2:]]
    assert len(strings) == 15 and all(strings)
    assert [s for s in strings if s not in code] == []


def test_grpo_py_depends_on_torch_alone():
    import ast

    tree = ast.parse(source("grpo.py"))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    }
    assert imported == {"torch"}
    internals = ["lm_head", "past_key_values", "logits_to_keep", "generation_config", "model.model"]
    assert [name for name in internals if name in source("grpo.py")] == []


def test_train_reads_as_algorithm_1_every_numbered_line_in_order():
    # DeepSeekMath's Algorithm 1, lines 1 and 3 to 11, each labelled in train() where it happens, in the paper's
    # order (line 2, the outer loop, and line 12, the reward model's update, have no code: one outer iteration).
    import ast

    tree = ast.parse(source("train.py"))
    (train,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train"]
    body = source("train.py").splitlines()[train.lineno - 1 : train.end_lineno]
    labels = [
        int(m)
        for line in body
        for m in re.findall(r"# (\d+): ", line) + re.findall(r"; (\d+): ", line)
    ]
    assert labels == [1, 3, 4, 5, 6, 7, 8, 9, 10, 11]
