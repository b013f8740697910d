"""Shape metrics of the runtime code (``rltjax/``, ``kernels/``, ``checkpoints/``).

    python scripts/code_metrics.py [ROOT]

Prints, from the abstract syntax trees alone:
- functions over 80 lines and modules over 300 lines;
- branches on execution modes in ``rltjax/engine``, ``rltjax/cache``, ``rltjax/models`` and
  ``kernels``: ``if`` / ``elif`` statements and conditional expressions whose test names a
  mode (the regular expressions of ``MODES``), by mode;
- the array parameters of each jitted device step (``@engine_jit`` functions: parameters
  before the keyword-only ones; a pytree counts as one);
- the largest signature (parameters of any function, ``self`` not counted).
ROOT defaults to this repository; point it at another checkout to compare.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

RUNTIME = ("rltjax", "kernels", "checkpoints")
BRANCH_DIRS = ("rltjax/engine", "rltjax/cache", "rltjax/models", "kernels", "rltjax/kernels")
MODES = {
    "window vs step": r"window|fixed_trip|inflight|in_flight",
    "mixed prefill": r"mixed|prompt_args|\bprompt\b|prompt is|prompt_tokens",
    "boundary stages": r"boundary|\bbkv\b|bmeta|has_boundary",
    "standby": r"standby|swap_every_pass",
    "async passes": r"async|pending",
}


def runtime_files(root: Path) -> list[Path]:
    files = []
    for top in RUNTIME:
        files += sorted(p for p in (root / top).rglob("*.py") if "benchmarks" not in p.parts)
    return files


def _params(fn: ast.FunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return len([n for n in names if n not in ("self", "cls")])


def _is_engine_jit(fn: ast.FunctionDef) -> bool:
    return any("engine_jit" in ast.unparse(d) for d in fn.decorator_list)


def measure(root: Path) -> dict:
    long_functions, long_modules, largest, steps = [], [], (0, ""), {}
    branches = {mode: 0 for mode in MODES}
    for path in runtime_files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        tree = ast.parse(text)
        lines = len(text.splitlines())
        if lines > 300:
            long_modules.append((rel, lines))
        in_branch_dirs = any(rel.startswith(d + "/") for d in BRANCH_DIRS)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long_functions.append((f"{rel}:{node.name}", n))
                if _params(node) > largest[0]:
                    largest = (_params(node), f"{rel}:{node.name}")
                if _is_engine_jit(node):
                    a = node.args
                    steps[f"{rel}:{node.name}"] = len(a.posonlyargs + a.args)
            if in_branch_dirs and isinstance(node, (ast.If, ast.IfExp)):
                test = ast.unparse(node.test)
                for mode, pattern in MODES.items():
                    if re.search(pattern, test):
                        branches[mode] += 1
    return dict(long_functions=sorted(long_functions, key=lambda x: -x[1]),
                long_modules=sorted(long_modules, key=lambda x: -x[1]), branches=branches,
                step_arrays=steps, largest_signature=largest)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    m = measure(root)
    print(f"functions over 80 lines: {len(m['long_functions'])}")
    for name, n in m["long_functions"]:
        print(f"  {n:4d} {name}")
    print(f"modules over 300 lines: {len(m['long_modules'])}")
    for name, n in m["long_modules"]:
        print(f"  {n:4d} {name}")
    print(f"mode branches: {sum(m['branches'].values())} " + ", ".join(f"{k} {v}" for k, v in m["branches"].items()))
    print(f"array parameters of the jitted device steps: max {max(m['step_arrays'].values(), default=0)}")
    for name, n in sorted(m["step_arrays"].items()):
        print(f"  {n:4d} {name}")
    print(f"largest signature: {m['largest_signature'][0]} parameters ({m['largest_signature'][1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
