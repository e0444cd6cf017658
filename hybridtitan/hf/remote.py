"""The code an export carries: hybridtitan's own modules, written flat into the folder, so that
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` runs exactly the code the package runs,
where hybridtitan is not installed (torch and transformers suffice; FLA's kernels on GPUs where it imports).

transformers loads ``auto_map``'s two files and every file they import relatively, from one folder: package paths
do not survive, so each module becomes a file of its own, ``hybridtitan/models/mla.py`` ->
``hybridtitan_models_mla.py``, and its imports of hybridtitan are rewritten to relative imports of those files
(``from hybridtitan.models.args import MLAArgs`` -> ``from .hybridtitan_models_args import MLAArgs``). The entry
points keep transformers' names, ``configuration_hybridtitan.py`` and ``modeling_hybridtitan.py``. Nothing else of
the code changes. transformers copies into its module cache only the files that a ``from .x import`` line names,
so the modeling file ends with a function, never called, that names every file.
"""

from __future__ import annotations

import ast
import os

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hybridtitan/

# The modules an export needs (HybridLM, its ops, the Hugging Face classes), by package path; the two entry points
# first.
MODULES = (
    "hf/configuration.py", "hf/modeling.py",
    "models/__init__.py", "models/args.py", "models/pattern.py", "models/flavors.py", "models/modules.py",
    "models/rope.py", "models/mla.py", "models/gqa.py", "models/gdn.py", "models/kda.py", "models/mamba2.py",
    "models/model.py",
    "ops/__init__.py", "ops/chunking.py", "ops/context_parallel.py", "ops/reference.py", "ops/cross_entropy.py",
    "ops/kl_div.py", "ops/cuda_graphs.py", "ops/fla_backend.py", "ops/conv_triton.py",
    "ops/cross_entropy_triton.py", "ops/kl_div_triton.py",
    "parallel.py",
)
ENTRY_POINTS = {"hf/configuration.py": "configuration_hybridtitan", "hf/modeling.py": "modeling_hybridtitan"}


def module_name(path: str) -> str:
    """"models/mla.py" -> "hybridtitan.models.mla"; "ops/__init__.py" -> "hybridtitan.ops"."""
    parts = ["hybridtitan", *path.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FLAT = {module_name(p): ENTRY_POINTS.get(p, module_name(p).replace(".", "_")) for p in MODULES}
FILES = tuple(f"{FLAT[module_name(p)]}.py" for p in MODULES)


class BundleError(RuntimeError):
    """A module of the export imports hybridtitan code that the export does not carry."""


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _rewritten(module: str, node: ast.ImportFrom, is_package: bool) -> str | None:
    """The relative import that replaces ``node`` in the flat file, or None where it imports no hybridtitan code."""
    target = _absolute(module, node, is_package)
    if target != "hybridtitan" and not target.startswith("hybridtitan."):
        return None
    lines = []
    names = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        if sub in FLAT:  # a module: imported whole, under its name
            lines.append(f"from . import {FLAT[sub]} as {alias.asname or alias.name}")
        elif target in FLAT:
            names.append(alias.name + (f" as {alias.asname}" if alias.asname else ""))
        else:
            raise BundleError(f"{module} imports {sub}, which an export does not carry")
    if names:
        lines.insert(0, f"from .{FLAT[target]} import {', '.join(names)}")
    return "; ".join(lines)


def flat_source(path: str) -> str:
    """The source of the package module at ``path`` with its imports of hybridtitan made relative to flat files."""
    module = module_name(path)
    with open(os.path.join(PACKAGE_ROOT, path)) as f:
        source = f.read()
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "hybridtitan" for a in node.names):
            raise BundleError(f"{module} line {node.lineno}: write 'from hybridtitan... import ...'")
        if isinstance(node, ast.ImportFrom):
            new = _rewritten(module, node, path.endswith("__init__.py"))
            if new is not None:
                edits.append((node.lineno, node.end_lineno, node.col_offset, new))
    for start, end, col, new in sorted(edits, reverse=True):
        lines[start - 1:end] = [" " * col + new + "\n"]
    header = f"# hybridtitan/{path}, written into this folder by hybridtitan's export (hybridtitan.hf.remote)\n"
    return header + "".join(lines)


def write_model_code(folder: str) -> list[str]:
    """Writes every file of FILES into ``folder``; returns their names."""
    for path in MODULES:
        text = flat_source(path)
        if path == "hf/modeling.py":
            others = "\n".join(f"    from .{name.removesuffix('.py')} import __name__  # noqa: F401"
                               for name in FILES if name != "modeling_hybridtitan.py")
            text += ("\n\ndef _files_of_this_model():\n    \"\"\"Never called: it names every file of the folder's "
                     "code, which transformers' loader\n    copies into its module cache only where a relative "
                     "import names it.\"\"\"\n" + others + "\n")
        with open(os.path.join(folder, f"{FLAT[module_name(path)]}.py"), "w") as f:
            f.write(text)
    return list(FILES)
