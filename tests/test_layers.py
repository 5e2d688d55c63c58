"""One direction of data: a lower layer never imports a higher one.

The layer table is the one in docs/architecture.md. A module may import its
own package and anything on a strictly lower layer; a new top-level module
must be given a layer here (the test fails until it is).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fsdp_sentinel"

LAYERS: dict[str, int] = {
    # contracts and facts about this process: import nothing of ours
    "__init__": 0,
    "trace": 0,
    "rankstep": 0,
    "snapshot": 0,
    "buckets": 0,
    "hostinfo": 0,
    "interrupts": 0,
    "truth": 0,
    "cost": 0,
    "progress": 0,
    # sources of records
    "emit": 1,
    "trace_segments": 1,
    "probes": 1,
    "synth": 1,
    "hooks": 2,
    "trainer": 3,
    # the brain
    "ranktotals": 1,
    "flowstore": 1,
    "correlate": 2,
    "stream": 2,
    "fabric": 2,
    "detect": 3,
    "pipeline": 4,
    # consumers of the pipeline's output, and the lab
    "jobs": 5,
    "cluster": 5,
    "replay": 6,
    "ingest": 5,
    "exporters": 5,
    "report": 6,
    "lab": 5,
    "remediate": 5,
    "live": 6,
    # assemblies
    "daemon": 7,
    "demo": 8,
    "cli": 9,
    "__main__": 10,
}


def top_module(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def is_module(name: str) -> bool:
    return (PKG / f"{name}.py").exists() or (PKG / name / "__init__.py").exists()


def imported_tops(tree: ast.AST) -> set[str]:
    tops: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "fsdp_sentinel":
                # ``from fsdp_sentinel import x``: x is a module, or a name of __init__
                names = [
                    f"fsdp_sentinel.{a.name}" if is_module(a.name) else "fsdp_sentinel.__init__"
                    for a in node.names
                ]
        for name in names:
            parts = name.split(".")
            if parts[0] == "fsdp_sentinel" and len(parts) > 1:
                tops.add(parts[1])
    return tops


def package_files() -> list[Path]:
    # rglob does not follow the probes/ and exporters/ symlinks; walk them too.
    files = list(PKG.glob("*.py"))
    for sub in PKG.iterdir():
        if sub.is_dir() and (sub / "__init__.py").exists():
            files += [p for p in sub.rglob("*.py")]
    return files


def test_every_module_has_a_layer() -> None:
    tops = {top_module(p) for p in package_files()}
    assert tops - set(LAYERS) == set(), "give new modules a layer in tests/test_layers.py"


def test_no_module_imports_a_higher_or_equal_layer() -> None:
    bad: list[str] = []
    for path in package_files():
        me = top_module(path)
        for other in imported_tops(ast.parse(path.read_text())):
            if other == me or other == "__init__":
                continue
            if LAYERS.get(other, 99) >= LAYERS[me]:
                bad.append(f"{path.relative_to(ROOT)}: {me} (layer {LAYERS[me]}) imports {other}")
    assert bad == []


# Inside detect: each rule is a pure module of its own, ordered by ``detector``.
DETECT = PKG / "detect"
DETECT_SHARED = {"config", "state", "stats"}  # what every rule may lean on
DETECT_RULES = {"baseline", "noise", "compute", "network", "lost", "persistence"}
IO_MODULES = {"os", "io", "pathlib", "socket", "subprocess", "time", "threading", "logging"}


def detect_imports(path: Path) -> tuple[set[str], set[str]]:
    """(sibling modules of detect, stdlib top-level modules) that ``path`` imports."""
    siblings: set[str] = set()
    stdlib: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "fsdp_sentinel.detect":
                siblings |= {a.name for a in node.names}
            elif node.module.startswith("fsdp_sentinel.detect."):
                siblings.add(node.module.split(".")[2])
            else:
                stdlib.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            stdlib |= {a.name.split(".")[0] for a in node.names}
    return siblings, stdlib


def test_detect_rules_are_independent_and_pure() -> None:
    names = {p.stem for p in DETECT.glob("*.py")}
    assert names >= DETECT_RULES, "a rule named here is missing from fsdp_sentinel/detect/"
    bad: list[str] = []
    for path in sorted(DETECT.glob("*.py")):
        siblings, stdlib = detect_imports(path)
        if path.stem in DETECT_RULES and siblings - DETECT_SHARED:
            bad.append(f"rule {path.stem} imports {sorted(siblings - DETECT_SHARED)}")
        if path.stem in DETECT_SHARED and siblings - DETECT_SHARED:
            bad.append(f"{path.stem} imports {sorted(siblings - DETECT_SHARED)}")
        # config reads its own file (DetectConfig.from_file); nothing else does I/O
        if path.stem != "config" and stdlib & IO_MODULES:
            bad.append(f"{path.stem} imports {sorted(stdlib & IO_MODULES)}")
    assert bad == []
