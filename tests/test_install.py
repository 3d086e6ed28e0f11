"""What a fresh install gets: no repo module hides an installed package, the distribution installs
only the project's own packages, the locks README and CI install from, and where caches go."""

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN_DISTRIBUTION = "gpt2-fused"
OWN_PACKAGES = {"gpt2_fused", "fused_loss"}
CLONE_ONLY = {"gpt2_fused.training"}  # imports the clone's model.py: runs from the clone


def repo_top_level_names(root=REPO):
    """The names `import X` finds at the repo root (from the clone, or with the root on sys.path):
    X.py, X/__init__.py, and folders of .py files without one (namespace packages)."""
    names = set()
    for entry in os.scandir(root):
        if entry.name.startswith((".", "_")):
            continue
        if entry.is_file() and entry.name.endswith(".py"):
            names.add(entry.name[:-3])
        elif entry.is_dir() and any(f.endswith(".py") for f in os.listdir(entry.path)):
            names.add(entry.name)
    return names


def shadowed(names):
    """{name: installed distributions that also install top-level `name`}, ours left out."""
    own = re.sub(r"[-_.]+", "-", OWN_DISTRIBUTION).lower()
    installed = importlib.metadata.packages_distributions()
    found = {}
    for name in sorted(names):
        dists = {d for d in installed.get(name, []) if re.sub(r"[-_.]+", "-", d).lower() != own}
        if dists:
            found[name] = sorted(dists)
    return found


def test_no_repo_module_shadows_an_installed_distribution():
    """From the clone, the repo's top-level modules come first on sys.path: one that shares its
    name with an installed package hides that package from every dependency that imports it."""
    clashes = shadowed(repo_top_level_names())
    assert not clashes, (
        f"repo modules hide installed packages of the same name: {clashes}; rename them or "
        "move them under gpt2_fused/"
    )


def test_the_shadowing_check_names_a_clash(tmp_path):
    """A kernels/ package at the root, as there once was, is caught while Hugging Face's kernels
    (which transformers imports) is installed; any installed top-level name serves without it."""
    installed = importlib.metadata.packages_distributions()
    public = sorted(n for n in installed if not n.startswith((".", "_")))  # as the scan sees
    name = "kernels" if "kernels" in installed else public[0]
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "train.py").write_text("")
    assert repo_top_level_names(tmp_path) == {name, "train"}
    assert list(shadowed(repo_top_level_names(tmp_path))) == [name]


def load_pyproject():
    try:
        import tomllib
    except ImportError:  # Python 3.10: tomli, which pytest itself needs there
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def package_modules(packages, root=REPO):
    """The .py files (relative paths) of the listed packages, subpackages not included."""
    return {
        os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
        for d in (os.path.join(root, *p.split(".")) for p in packages)
        for f in os.listdir(d)
        if f.endswith(".py")
    }


def test_pyproject_installs_only_the_projects_own_packages():
    """No py-modules and no data package: the commands run from the clone, so `pip install -e .`
    puts nothing named train, model, data or kernels into site-packages. Of the project's own
    packages, all but the commands' plumbing ship (it needs model.py: pyproject.toml says why)."""
    st = load_pyproject()["tool"]["setuptools"]
    assert "py-modules" not in st and "data" not in st.get("package-data", {})
    packages = set(st["packages"])
    assert {p.split(".")[0] for p in packages} == OWN_PACKAGES
    on_disk = {
        os.path.relpath(d, REPO).replace(os.sep, ".")
        for top in OWN_PACKAGES
        for d, _, files in os.walk(os.path.join(REPO, top))
        if "__init__.py" in files
    }
    assert packages == on_disk - CLONE_ONLY  # a subpackage left out is an ImportError installed


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel setuptools builds from pyproject.toml, from a copy of what it reads."""
    setuptools = pytest.importorskip("setuptools")
    old = tuple(int(v) for v in setuptools.__version__.split(".")[:2]) < (70, 1)
    if old and importlib.util.find_spec("wheel") is None:  # built without isolation here
        pytest.skip("setuptools < 70.1 builds wheels through the wheel package, not installed")
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", *OWN_PACKAGES):
        subprocess.run(["cp", "-r", os.path.join(REPO, name), str(src)], check=True)
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation"]
    res = subprocess.run([*cmd, "-q", "-w", str(out)], capture_output=True, text=True)
    if res.returncode != 0 and "No module named pip" in res.stderr:
        pytest.skip("no pip in this environment")
    assert res.returncode == 0, res.stdout + res.stderr
    (path,) = out.glob("gpt2_fused-*.whl")
    return path


def test_wheel_holds_only_the_projects_own_packages(wheel):
    """Every module of the packages pyproject.toml lists, and nothing else."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")]
    assert set(names) == package_modules(load_pyproject()["tool"]["setuptools"]["packages"])
    assert {n.split("/")[0] for n in names} == OWN_PACKAGES


# Run by a fresh venv's python from outside the clone: imports each module the installed
# distribution lists, says where each came from, and calls the fused loss once (on CPU in the
# Triton interpreter, as TRITON_INTERPRET=1 from conftest.py asks).
IMPORT_ALL = """
import importlib, importlib.metadata, json, sys
files = [f for f in importlib.metadata.files("gpt2-fused") if f.suffix == ".py"]
names = [".".join(f.with_suffix("").parts).removesuffix(".__init__") for f in files]
where = {n: importlib.import_module(n).__file__ for n in names}
import torch
from fused_loss import fused_linear_cross_entropy as loss
x, w, t = torch.randn(6, 8), torch.randn(11, 8), torch.tensor([0, 3, -100, 10, 2, 5])
diff = (loss(x, w, t) - torch.nn.functional.cross_entropy(x @ w.T, t)).abs().item()
print(json.dumps(dict(where=where, path=sys.path, diff=diff)))
"""


def test_the_installed_wheel_imports_every_module_it_ships(wheel, tmp_path):
    """pip installs the wheel into a fresh venv, whose python, started outside the clone, imports
    every module it ships from there. The venv borrows this environment's copies of the declared
    dependencies (torch, triton, ...) through a .pth line naming their folder, which adds it
    without running its .pth files: an editable install of this clone cannot join sys.path."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    inner = subprocess.run([python, "-c", purelib], capture_output=True, text=True, check=True)
    site = inner.stdout.strip()
    deps = [re.match(r"[\w.-]+", d)[0] for d in load_pyproject()["project"]["dependencies"]]
    specs = [importlib.util.find_spec(d) for d in deps]  # what test_layout.py lets the wheel use
    outer = {os.path.dirname(os.path.dirname(s.origin)) for s in specs if s and s.origin}
    with open(os.path.join(site, "borrowed.pth"), "w") as f:
        f.write("".join(d + "\n" for d in sorted(outer)))
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index"]
    res = subprocess.run([*pip, "-q", str(wheel)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # TRITON_INTERPRET stays
    res = subprocess.run(
        [python, "-c", IMPORT_ALL], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert not [p for p in got["path"] if p == REPO or p.startswith(REPO + os.sep)]
    with zipfile.ZipFile(wheel) as z:
        shipped = {n for n in z.namelist() if n.endswith(".py")}
    assert {os.path.relpath(f, site).replace(os.sep, "/") for f in got["where"].values()} == shipped
    assert got["diff"] < 1e-4


# ---------------------------------------------------------------- the locks, README and CI


def readme_commands():
    """The two install-and-run commands at the top of README.md."""
    text = open(os.path.join(REPO, "README.md")).read()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return block.strip().splitlines()


def lock_pins(name):
    """{package: {versions}} of requirements/NAME.txt, each pin with its hashes."""
    text = open(os.path.join(REPO, "requirements", f"{name}.txt")).read()
    pins = {}
    for req in re.split(r"\n(?=\S)", text):
        m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", req)
        if m:
            assert "--hash=sha256:" in req, f"{name}.txt: {m[0]} has no hash"
            pins.setdefault(m[1].lower(), set()).add(m[2])
    return pins


def test_readme_installs_from_the_locks_and_ci_runs_its_test_command():
    run, test = readme_commands()
    for line, lock, then in (
        (run, "run", "python train.py"),
        (test, "test", "python -m pytest -q"),
    ):
        steps = line.split(" && ")
        assert steps[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"], line
        assert steps[2:] == [
            "pip install torch==2.13.0",
            f"pip install --require-hashes -r requirements/{lock}.txt",
            then,
        ]
    # .ci/run makes its own fresh venv, then runs the rest of the second command as it is
    ci = open(os.path.join(REPO, ".ci", "run")).read().splitlines()
    assert " && ".join(test.split(" && ")[2:]) in ci


def test_locks_pin_tested_versions_and_leave_torch_out():
    """torch is installed first (its CPU or CUDA wheel); triton is the one torch 2.13.0's CUDA
    wheel requires; what both locks hold, they pin alike, so the tests run what training runs."""
    run, test = lock_pins("run"), lock_pins("test")
    for pins in (run, test):
        assert "torch" not in pins and pins["triton"] == {"3.7.1"}
    assert set(run) <= set(test)
    assert {k: v for k, v in run.items() if test[k] != v} == {}
    for name in ("run", "test"):  # each lock comes from its .in by the command its header names
        header = open(os.path.join(REPO, "requirements", f"{name}.in")).read()
        cmd = re.search(r"^#\s+(uv pip compile .*?\.txt)$", header, re.M | re.S).group(1)
        cmd = " ".join(cmd.replace("\\\n#", " ").split())
        lock = open(os.path.join(REPO, "requirements", f"{name}.txt")).read()
        assert cmd in lock.replace("\n#    ", " "), name


# ---------------------------------------------------------------- caches


def tree(path):
    return {
        (d, f, os.stat(os.path.join(d, f)).st_mtime_ns)
        for d, _, files in os.walk(path)
        for f in files
    }


def test_cache_env_moves_every_cache_out_of_the_clone(tmp_path):
    """GPT2_FUSED_CACHE: the embedded dataset's shards and HellaSwag's file go there, and nothing
    is written under the repo's data/cache."""
    repo_cache = os.path.join(REPO, "data", "cache")
    before = tree(repo_cache)
    code = (
        "from data import hellaswag, resolve_dataset; from data.prepare import CACHE_DIR; "
        "train = resolve_dataset('embedded')[0]; print(CACHE_DIR, hellaswag.DEFAULT_PATH, train)"
    )
    env = dict(os.environ, GPT2_FUSED_CACHE=str(tmp_path))
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    cache, hs, train_glob = res.stdout.strip().splitlines()[-1].split()
    assert cache == str(tmp_path) and hs == str(tmp_path / "hellaswag" / "hellaswag_val.jsonl")
    assert train_glob.startswith(str(tmp_path / "embedded-"))
    assert list(tmp_path.glob("embedded-*/embedded_train_000001.bin"))
    assert tree(repo_cache) == before


def test_cache_defaults_to_the_clones_data_cache():
    env = {k: v for k, v in os.environ.items() if k != "GPT2_FUSED_CACHE"}
    code = "from data.prepare import CACHE_DIR; print(CACHE_DIR)"
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == os.path.join(REPO, "data", "cache")


def test_pyproject_admits_only_the_tested_torch_versions():
    """`pip install -e .[test]` must not resolve a torch that README calls untested."""
    from packaging.requirements import Requirement

    deps = [Requirement(d) for d in load_pyproject()["project"]["dependencies"]]
    (torch_req,) = [r for r in deps if r.name == "torch"]
    tested, untested = ("2.11.0", "2.13.0", "2.13.1"), ("2.10.0", "2.12.0", "2.14.1", "2.15.0")
    assert all(torch_req.specifier.contains(v) for v in tested)
    assert not any(torch_req.specifier.contains(v) for v in untested)
