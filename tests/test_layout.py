"""The repo's import graph, read from the source (ast, nothing imported): imports go one way, as
README.md's "Files" says, no command imports another, and no module reaches into another's
private names. A new upward import or a `from x import _name` fails here with the place."""

import ast
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# lowest first: a module may import its own layer and the ones before it
LAYERS = ["gpt2_fused.kernels", "fused_loss", "model", "gpt2_fused.training", "data", "commands"]
COMMANDS = {"train", "sample", "eval_hellaswag"}


def layer(module):
    """The layer index of a repo module's dotted name, or None outside the layers (bench, tests,
    third-party packages)."""
    if module in COMMANDS:
        return LAYERS.index("commands")
    if module == "gpt2_fused":  # the package's own __init__: a docstring
        return 0
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return None


def sources():
    """(dotted module name, path) of every product module: the layers' files."""
    for path in sorted(ROOT.glob("*.py")):
        yield path.stem, path
    for package in ("gpt2_fused", "fused_loss", "data"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            yield ".".join(p for p in parts if p != "__init__"), path


def imports(path):
    """(line, imported module, names taken from it) for each import in a file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def package(module):
    """The package a module belongs to, whose modules may share private names: its top-level
    name (gpt2_fused.training and gpt2_fused.kernels are two)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "gpt2_fused" else parts[0]


def private_reaches(path, own):
    """`module._name` uses in a file where `module` is a repo module of another package."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:  # `from pkg import module`
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    hits = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            target = aliases.get(node.value.id)
            if target and layer(target) is not None and package(target) != package(own):
                hits.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return hits


@pytest.mark.parametrize("module, path", list(sources()), ids=lambda v: str(v))
def test_imports_go_one_way_and_stay_public(module, path):
    mine = layer(module)
    assert mine is not None, module
    wrong = []
    for line, target, names in imports(path):
        theirs = layer(target)
        if theirs is None:
            continue
        rel = path.relative_to(ROOT)
        if theirs > mine:
            wrong.append(
                f"{rel}:{line} imports {target} ({LAYERS[theirs]} is above {LAYERS[mine]})"
            )
        if module in COMMANDS and target in COMMANDS and target != module:
            wrong.append(f"{rel}:{line}: the command {module} imports the command {target}")
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if private and package(target) != package(module):
            wrong.append(f"{rel}:{line} takes private names {private} from {target}")
    wrong += [f"{path.relative_to(ROOT)}:{h}" for h in private_reaches(path, module)]
    assert not wrong, "\n".join(wrong)


def test_the_checks_see_an_upward_import_and_a_private_name(tmp_path):
    """The walk above finds what it is for: a kernel importing the model, a private name."""
    bad = tmp_path / "bad.py"
    bad.write_text("import model\nfrom gpt2_fused.training import generate\ngenerate._step\n")
    found = imports(bad)
    assert [layer(t) for _, t, _ in found] == [
        LAYERS.index("model"),
        LAYERS.index("gpt2_fused.training"),
    ]
    assert private_reaches(bad, "gpt2_fused.kernels.mlp") == ["3: generate._step"]


# ---------------------------------------------------------------- what the wheel ships


def pyproject():
    try:
        import tomllib
    except ImportError:  # Python 3.10: tomli, which pytest itself needs there
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def in_wheel(module, shipped):
    """Whether the wheel ships a repo module, by its dotted name: a package (a folder) if listed,
    a module file if its folder is (gpt2_fused.training.x is not, though gpt2_fused is listed)."""
    if ROOT.joinpath(*module.split(".")).is_dir():
        return module in shipped
    return module.rpartition(".")[0] in shipped


def is_repo_module(name):
    """A dotted name of this clone's own: its first part is a .py file or a folder at the root."""
    top = name.split(".")[0]
    return (ROOT / f"{top}.py").is_file() or (ROOT / top).is_dir()


def outside_the_wheel(path, shipped, allowed):
    """(line, name) of each import of a file that the wheel alone cannot satisfy: a repo module it
    does not ship, or a third-party package that is not in `allowed`."""
    wrong = []
    for line, target, names in imports(path):
        if not is_repo_module(target):
            if target.split(".")[0] not in allowed:
                wrong.append((line, target))
            continue
        folder = ROOT.joinpath(*target.split("."))
        subs = [f"{target}.{n}" for n in names if (folder / f"{n}.py").is_file()]
        subs += [f"{target}.{n}" for n in names if (folder / n).is_dir()]
        wrong += [(line, m) for m in [target, *subs] if not in_wheel(m, shipped)]
    return wrong


SHIPPED = set(pyproject()["tool"]["setuptools"]["packages"])
DEPENDENCIES = {re.match(r"[\w.-]+", d)[0] for d in pyproject()["project"]["dependencies"]}


@pytest.mark.parametrize(
    "module, path", [(m, p) for m, p in sources() if in_wheel(m, SHIPPED)], ids=str
)
def test_the_wheel_imports_only_itself_the_standard_library_and_its_dependencies(module, path):
    """pyproject.toml ships the lowest layers as a library; none of their modules may import the
    clone (model.py, gpt2_fused/training/, data/, ...) or a package the wheel does not require."""
    allowed = set(sys.stdlib_module_names) | DEPENDENCIES
    wrong = outside_the_wheel(path, SHIPPED, allowed)
    assert not wrong, "\n".join(f"{path.relative_to(ROOT)}:{n} imports {t}" for n, t in wrong)


def test_the_wheel_check_sees_the_clone_and_an_undeclared_package(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\nimport model\nfrom gpt2_fused import training\n"
        "from gpt2_fused.kernels import mlp\nimport yaml\n"
        "from gpt2_fused.training.errors import UsageError\n"
    )
    wrong = outside_the_wheel(bad, {"gpt2_fused", "gpt2_fused.kernels"}, {"torch"})
    assert wrong == [
        (2, "model"),
        (3, "gpt2_fused.training"),
        (5, "yaml"),
        (6, "gpt2_fused.training.errors"),
    ]


# a newcomer reads these whole: past these sizes a part belongs in a module of its own
SIZES = {"train.py": 450, "model.py": 450, "sample.py": 450}  # lines
MAIN_LINES = 150  # train.py's main(), read top to bottom


@pytest.mark.parametrize("name, limit", SIZES.items())
def test_the_commands_and_the_model_stay_readable_in_one_sitting(name, limit):
    lines = (ROOT / name).read_text().count("\n")
    assert lines <= limit, f"{name} has {lines} lines, over {limit}"


def test_train_main_reads_top_to_bottom():
    tree = ast.parse((ROOT / "train.py").read_text())
    main = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "main")
    lines = main.end_lineno - main.lineno + 1
    assert lines <= MAIN_LINES, f"train.py's main() has {lines} lines, over {MAIN_LINES}"
