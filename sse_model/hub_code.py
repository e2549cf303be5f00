"""The model's code saved beside its weights, so that a checkpoint the pipeline writes loads with
`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` where sse-rl is not installed (a Hub upload,
another team's machine), and natively, through the Auto classes `import sse_model` registers, where it is.

transformers loads remote code from flat modules in the checkpoint's folder: the module `auto_map` names, and the
ones it imports relatively, found by the pattern `from .<name> import` (dynamic_module_utils). So every project
module the model imports, sse_model's and the torch paths of kernels/, is written as one flat file whose project
imports are made relative; an import of a module object (`import kernels`, `from kernels import kept_weights`)
becomes `from . import <flat> as <name>` after a `from .<flat> import <a name the file uses> as _<flat>` that
lets transformers find it. The Triton kernels stay out: kernels.dispatch imports them lazily from its own package, finds
none there, and runs the torch paths.
"""
import ast
import importlib.util
import json
from pathlib import Path

ROOTS = ("sse_model.configuration_sse", "sse_model.modeling_sse")
PROJECT_PACKAGES = ("sse_model", "kernels")
AUTO_MAP = {"AutoConfig": "configuration_sse.SSEConfig", "AutoModel": "modeling_sse.SSEModel",
            "AutoModelForCausalLM": "modeling_sse.SSEForCausalLM"}


def flat_name(module: str) -> str:
    """`sse_model.modeling_sse` -> `modeling_sse`, `kernels.sse.chunk` -> `kernels_sse_chunk`; `kernels` stays."""
    parts = module.split(".")
    return "_".join(parts[1:] if parts[0] == "sse_model" else parts)


def _is_module(package: str, name: str) -> bool:
    """Whether `from package import name` imports a module (and not a name the package defines)."""
    spec = importlib.util.find_spec(package)
    return spec.submodule_search_locations is not None and importlib.util.find_spec(f"{package}.{name}") is not None


def _source(module: str) -> tuple[str, ast.Module]:
    text = Path(importlib.util.find_spec(module).origin).read_text()
    return text, ast.parse(text)


def _project_imports(tree: ast.Module):
    """The statements of `tree` that import from the project, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] in PROJECT_PACKAGES for a in node.names):
            yield node
        elif isinstance(node, ast.ImportFrom) and (node.level or node.module.split(".")[0] in PROJECT_PACKAGES):
            if node.level:
                raise ValueError(f"line {node.lineno}: relative import; the project imports absolutely")
            yield node


def _rewrite(node, tree: ast.Module) -> tuple[list[str], set[str]]:
    """The relative import lines that replace `node` and the project modules they need."""
    lines, needed = [], set()

    def module_object(module: str, name: str):
        used = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                       and isinstance(n.value, ast.Name) and n.value.id == name})
        if not used:
            raise ValueError(f"{name} ({module}) is imported but no attribute of it is used")
        flat = flat_name(module)
        lines.append(f"from .{flat} import {used[0]} as _{flat}  # noqa: F401 (lets transformers find {flat}.py)")
        lines.append(f"from . import {flat}" + ("" if flat == name else f" as {name}"))
        needed.add(module)

    if isinstance(node, ast.Import):
        for alias in node.names:
            if "." in alias.name and not alias.asname:
                raise ValueError(f"line {node.lineno}: `import {alias.name}`: import it with `from`")
            module_object(alias.name, alias.asname or alias.name)
        return lines, needed
    names = []
    for alias in node.names:
        if _is_module(node.module, alias.name):
            module_object(f"{node.module}.{alias.name}", alias.asname or alias.name)
        else:
            names.append(alias.name + (f" as {alias.asname}" if alias.asname else ""))
    if names:
        lines.append(f"from .{flat_name(node.module)} import {', '.join(names)}")
        needed.add(node.module)
    return lines, needed


def bundle() -> dict[str, str]:
    """{flat file name: source} of every project module the model needs, its project imports made relative."""
    files, todo = {}, list(ROOTS)
    while todo:
        module = todo.pop()
        name = f"{flat_name(module)}.py"
        if name in files:
            continue
        text, tree = _source(module)
        lines = text.splitlines(keepends=True)
        # replace statements bottom-up, so that the line numbers of those above still hold
        for node in sorted(_project_imports(tree), key=lambda n: n.lineno, reverse=True):
            new, needed = _rewrite(node, tree)
            indent = " " * node.col_offset
            lines[node.lineno - 1:node.end_lineno] = [f"{indent}{line}\n" for line in new]
            todo.extend(needed)
        files[name] = "".join(lines)
    return files


def save_model_code(folder: str | Path) -> None:
    """Write the bundle into the checkpoint `folder` (already holding config.json) and point its `auto_map` at it."""
    folder = Path(folder)
    for name, text in bundle().items():
        (folder / name).write_text(text)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = AUTO_MAP
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
