"""The shape of the code, as the README promises it: its equation map points at lines of grpo.py, grpo.py imports
torch alone, and no function of the modules is longer than 60 lines. Files are read relative to the repository root
(HERE, conftest.py's directory).
"""
import os

from conftest import HERE


def source(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


def test_readme_equation_map_points_at_lines_of_grpo_py():
    readme, code = source("README.md"), source("grpo.py")
    table = readme.split("## Equation to code")[1].split("\n\n")[2]  # the table after the section's first paragraph
    strings = [row.rsplit("|", 2)[1].strip().strip("`") for row in table.splitlines()[2:]]
    assert len(strings) == 15 and all(strings)
    assert [s for s in strings if s not in code] == []


def test_grpo_py_depends_on_torch_alone():
    import ast
    tree = ast.parse(source("grpo.py"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"torch"}
    internals = ["lm_head", "past_key_values", "logits_to_keep", "generation_config", "model.model"]
    assert [name for name in internals if name in source("grpo.py")] == []


def test_no_function_is_longer_than_60_lines():
    import ast
    long = []
    for name in sorted(f for f in os.listdir(HERE) if f.endswith(".py") and not f.startswith("test_")):
        for node in ast.walk(ast.parse(source(name))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - first + 1 > 60:
                    long.append(f"{name}:{node.name}")
    assert long == []
