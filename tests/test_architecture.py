"""The repository's structure: no import cycle anywhere, no private name used across modules or versions, and
files small enough to read in one sitting (tests: 500 lines; harness, benchmarks and version scripts: 400).

Imports are read with `ast` (nothing is imported), every import statement counts, also those inside a function
(a lazy import still runs, later). Modules: the harness package tinytransformer/, the version directories (packages:
version1_pytorch_baseline.tiny_llama_v1, version3_triton.kernels.rmsnorm, ...), the benchmark scripts and
sample.py. A script imports its sibling files by their bare names (`from table_format import fmt`: its directory
is on sys.path), so a bare name is looked up beside the importing file first. Importing a.b.c also runs the
__init__.py of a and a.b, so those count as imported too.
"""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = ["tinytransformer", "benchmarks", "sample.py"] + sorted(p.name for p in REPO.glob("version*") if p.is_dir())
# One job a file: a file that grows past this has started a second job. The models, kernels and exercise files of
# the version directories are teaching files, read as a whole, and are not held to it; their scripts are.
MAX_LINES = {"tinytransformer": 400, "benchmarks": 400, "tests": 500,
             **{p.name: 400 for p in REPO.glob("version*") if p.is_dir()}}
TEACHING_FILES = ("tiny_llama_v*.py", "kernels/*.py", "exercises/**/*.py")


def python_files() -> list[Path]:
    files = []
    for root in ROOTS:
        path = REPO / root
        candidates = [path] if path.is_file() else path.rglob("*.py")
        files += [p for p in candidates if "__pycache__" not in p.parts]
    return sorted(files)


def module_name(path: Path) -> str:
    """a/b/c.py -> "a.b.c", a/b/__init__.py -> "a.b"; a script outside any package is named by its path too."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def import_base(node: ast.ImportFrom, package: str) -> str:
    """The absolute dotted module of `from X import ...` written in `package` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    anchor = package.split(".")
    anchor = anchor[:len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def imported_names(path: Path, name: str) -> list[tuple[str, int]]:
    """(absolute dotted name, line) of every import in the file: `import a.b` gives a.b; `from a import b, c`
    gives a.b and a.c (a submodule, or a name defined in a); relative imports are made absolute."""
    package = name if is_package(path) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = import_base(node, package)
            found += [(f"{base}.{alias.name}" if base else alias.name, node.lineno) for alias in node.names]
            found.append((base, node.lineno))
    return found


def resolve(target: str, importer: Path, modules: dict[str, Path]) -> list[str]:
    """The repository modules an import of `target` runs: the longest known prefix of the dotted name (a name
    defined in a module resolves to the module) and the packages above it. A bare name is first looked up beside
    the importer, as a script's directory is on sys.path."""
    sibling_prefix = module_name(importer).rpartition(".")[0]
    if sibling_prefix and f"{sibling_prefix}.{target.split('.')[0]}" in modules:
        target = f"{sibling_prefix}.{target}"
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return [".".join(parts[:i]) for i in range(1, end + 1) if ".".join(parts[:i]) in modules]
    return []


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first such import}; imports of outside packages are left out."""
    modules = {module_name(path): path for path in python_files()}
    graph = {}
    for name, path in modules.items():
        edges = {}
        for target, line in imported_names(path, name):
            for module in resolve(target, path, modules):
                if module != name:
                    edges.setdefault(module, line)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm), each as a cycle path."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [cycle_path(graph, set(component)) for component in components]


def cycle_path(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """One concrete cycle inside a strongly connected component: a -> b -> ... -> a."""
    start = min(component)
    path, seen = [start], {start}
    while True:
        node = path[-1]
        nxt = next(n for n in sorted(graph[node]) if n in component and (n == start or n not in seen))
        path.append(nxt)
        if nxt == start:
            return path
        seen.add(nxt)


def describe(graph: dict[str, dict[str, int]], path: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:])) + f" -> {path[-1]}"


def test_no_import_cycles():
    graph = import_graph()
    found = [describe(graph, path) for path in cycles(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_the_graph_sees_the_repository():
    """The test above checks something: the harness, the versions and the scripts are in the graph, with their
    relative, function-level and script-style imports."""
    graph = import_graph()
    assert "tinytransformer.training.checkpoint.files" in graph["tinytransformer.training.checkpoint.manager"]
    assert "tinytransformer.training.trainer" in graph["tinytransformer.cli"]        # imported inside run()
    assert "tinytransformer.training.checkpoint" in graph["tinytransformer.training.checkpoint.files"]
    assert "benchmarks.training_runs" in graph["benchmarks.compare_versions"]         # a script's sibling
    assert "tinytransformer.profiling.ranges" in graph["version1_pytorch_baseline.tiny_llama_v1"]
    assert "tinytransformer.training.checkpoint" in graph["tinytransformer.training.trainer"]   # packages above
    assert "sample" in graph
    stages = "version3_triton.exercises.performance_debugging.stages"   # a directory without __init__.py
    assert "version3_triton.tiny_llama_v3" in graph[stages]
    assert stages in graph["version3_triton.exercises.performance_debugging.run_stage"]


def layer_problems(graph: dict[str, dict[str, int]]) -> list[str]:
    """The rules of README's "Architecture" section: the harness (tinytransformer/) imports no version and no
    script; a version imports the harness, itself, and at most the public names of an EARLIER version (the
    private ones are test_no_private_names_across_modules_or_versions' concern), never a later one."""
    problems = []
    for importer, edges in graph.items():
        for imported, line in edges.items():
            own, theirs = version_of(importer), version_of(imported)
            if importer.startswith("tinytransformer") and not imported.startswith("tinytransformer"):
                problems.append(f"{importer} (line {line}) -> {imported}: the harness imports only itself")
            elif own and theirs and theirs > own:
                problems.append(f"{importer} (line {line}) -> {imported}: a version builds on earlier ones only")
            elif own and not (theirs or imported.startswith("tinytransformer")):
                problems.append(f"{importer} (line {line}) -> {imported}: a version imports no script")
    return problems


def test_imports_follow_the_layers():
    problems = layer_problems(import_graph())
    assert not problems, "\n".join(problems)


def test_layer_rules_catch_a_wrong_direction():
    graph = {"tinytransformer.cli": {"version1_pytorch_baseline.tiny_llama_v1": 3},
             "version3_triton.tiny_llama_v3": {"version4_triton_ultra.kernels.adamw": 5, "tinytransformer.cli": 6},
             "version4_triton_ultra.tiny_llama_v4": {"version3_triton.kernels.rope": 7, "benchmarks.variants": 8}}
    assert [p.split(":")[0] for p in layer_problems(graph)] == [
        "tinytransformer.cli (line 3) -> version1_pytorch_baseline.tiny_llama_v1",
        "version3_triton.tiny_llama_v3 (line 5) -> version4_triton_ultra.kernels.adamw",
        "version4_triton_ultra.tiny_llama_v4 (line 8) -> benchmarks.variants"]


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert describe(graph, ["a", "b", "c", "a"]) == "a (line 1) -> b (line 2) -> c (line 3) -> a"
    assert cycles({"a": {"b": 1}, "b": {}}) == []


# ----------------------------------------------------------------------------------------------------------
# Private names: what two modules share is public (no leading underscore), in one place
# ----------------------------------------------------------------------------------------------------------
def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def version_of(module: str) -> str | None:
    """"version3_triton" for version3_triton.kernels.rope; None for the harness, the benchmarks and scripts."""
    top = module.split(".")[0]
    return top if top.startswith("version") else None


def private_uses(path: Path, source: str, modules: dict[str, Path]) -> list[tuple[str, str, int, str]]:
    """(module, private name, line, "import" or "attribute") of each private name this file takes from ANOTHER
    repository module: `from m import _x` (an import), and `m._x` where the file bound m to a module
    (`import a.m as m`, `from a import m`: an attribute)."""
    name = module_name(path)
    package = name if is_package(path) else name.rpartition(".")[0]
    tree = ast.parse(source, filename=str(path))
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = import_base(node, package)
            for alias in node.names:
                resolved = resolve(f"{base}.{alias.name}" if base else alias.name, path, modules)
                if not resolved:
                    continue
                if resolved[-1].endswith(f".{alias.name}") or resolved[-1] == alias.name:   # a module
                    aliases[alias.asname or alias.name] = resolved[-1]
                elif is_private(alias.name) and resolved[-1] != name:
                    found.append((resolved[-1], alias.name, node.lineno, "import"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                resolved = resolve(alias.name, path, modules)
                if alias.asname and resolved and resolved[-1] == alias.name:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and is_private(node.attr) and aliases[node.value.id] != name):
            found.append((aliases[node.value.id], node.attr, node.lineno, "attribute"))
    return found


def private_name_problems() -> list[str]:
    """A private name imported from another module anywhere, or used from another version's module at all (a
    tool of a version, such as its kernel tuner, may reach into that version's own kernel module)."""
    modules = {module_name(p): p for p in python_files()}
    problems = []
    for name, path in modules.items():
        for owner, private, line, how in private_uses(path, path.read_text(encoding="utf-8"), modules):
            other_version = version_of(name) is not None and version_of(owner) not in (None, version_of(name))
            if how == "import" or other_version:
                problems.append(f"{path.relative_to(REPO)}:{line}: {owner}.{private} ({how})")
    return problems


def test_no_private_names_across_modules_or_versions():
    """A version keeps its own copy of what it needs from another version, or uses that version's public names;
    within a version, what one module takes from another is public too (rename it without the underscore)."""
    problems = private_name_problems()
    assert not problems, "private names used from another module:\n" + "\n".join(problems)


def test_private_name_finder_finds_them():
    modules = {module_name(p): p for p in python_files()}
    here = REPO / "version4_triton_ultra" / "kernels" / "example.py"   # never written: only its name is used
    source = ("from version3_triton.kernels.flash_attention import _launch_config, shape_problem\n"
              "from version3_triton.kernels import rope as r\n"
              "import version3_triton.kernels.rmsnorm as norms\n"
              "x = r._private_helper, r.rope_tables, norms._new_buffer, norms.__name__\n")
    found = private_uses(here, source, modules)
    assert sorted(found) == [("version3_triton.kernels.flash_attention", "_launch_config", 1, "import"),
                             ("version3_triton.kernels.rmsnorm", "_new_buffer", 4, "attribute"),
                             ("version3_triton.kernels.rope", "_private_helper", 4, "attribute")]


@pytest.mark.parametrize("root", sorted(MAX_LINES))
def test_files_stay_small(root):
    limit = MAX_LINES[root]
    teaching = {p for pattern in TEACHING_FILES for p in (REPO / root).glob(pattern)}
    long_files = {str(p.relative_to(REPO)): n for p in (REPO / root).rglob("*.py") if p not in teaching
                  and (n := len(p.read_text(encoding="utf-8").splitlines())) > limit}
    assert not long_files, f"over {limit} lines, split by concern: {long_files}"
