"""The keys hybridtitan reads, with their defaults and meaning: ``--help`` for the trainer and ``describe``, and
docs/config-reference.md (``python -m hybridtitan.describe --config-reference``).

Each key's type, default and description are its field's in hybridtitan.job_config: the type (a ``type_text`` in
the field's metadata where words say it better), the default, and the docstring (or trailing comment).
"""

import ast
import inspect
import textwrap
import typing
from dataclasses import fields, is_dataclass
from typing import Literal

MODEL_SUBSECTIONS = ("gdn", "kda", "mamba2", "mla", "gqa")


def _field_docs(cls) -> dict[str, str]:
    """Each field's docstring (the string literal after it) or, failing that, its trailing ``#`` comment."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    body = ast.parse(source).body[0].body
    docs = {}
    for node, after in zip(body, body[1:] + [None]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value,
                                                                                                 str):
            docs[node.target.id] = _flow(inspect.cleandoc(after.value.value))
        elif node.end_lineno == node.lineno:
            rest = lines[node.lineno - 1][node.end_col_offset:].strip()
            if rest.startswith("#"):
                docs[node.target.id] = rest[1:].strip()
    return docs


def _flow(doc: str) -> str:
    """A docstring's lines joined into paragraphs; a line that starts a list item ("- ...") stays a line."""
    out = []
    for line in doc.splitlines():
        line = line.strip()
        if out and line and not line.startswith("- ") and out[-1]:
            out[-1] += " " + line
        else:
            out.append(line)
    return "\n".join(line for line in out if line)


def choices_text(choices) -> str:
    """("a", "b", "c") -> "a, b or c": how help and errors name a key's choices."""
    words = [str(c) for c in choices]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def type_text(tp, f=None) -> str:
    """The key's type in words: its field's ``type_text`` metadata, else from the type."""
    if f is not None and "type_text" in f.metadata:
        return f.metadata["type_text"]
    origin = typing.get_origin(tp)
    if origin is Literal:
        return choices_text(typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp) or (str,)
        return f"list of {type_text(item)}"
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args and len(args) < len(typing.get_args(tp)):  # X | None
        return type_text(args[0])
    return "true or false" if tp is bool else getattr(tp, "__name__", str(tp))


def _entries(job_config_cls):
    """(section, [(key, type text, default, description)]) in the JobConfig's order."""
    defaults = job_config_cls()
    for section_field in fields(job_config_cls):
        section = section_field.name
        section_cls = type(getattr(defaults, section))
        docs = _field_docs(section_cls)
        hints = typing.get_type_hints(section_cls)
        rows = []
        for f in fields(section_cls):
            key = f"{section}.{f.name}"
            tp = hints[f.name]
            if section == "model" and f.name in MODEL_SUBSECTIONS:
                rows += _model_subsection(f.name, tp)
                continue
            if is_dataclass(tp):  # a subsection of its own, e.g. [validation.data]
                rows += _subsection(key, tp, getattr(getattr(defaults, section), f.name))
                continue
            rows.append((key, type_text(tp, f), getattr(getattr(defaults, section), f.name), docs.get(f.name, "")))
        if rows:
            yield section, rows


def _subsection(prefix: str, cls, defaults):
    """The keys of a subsection, those of its own subsections included ([quantize.linear.float8])."""
    docs = _field_docs(cls)
    hints = typing.get_type_hints(cls)
    rows = []
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            rows += _subsection(f"{prefix}.{f.name}", hints[f.name], getattr(defaults, f.name))
        else:
            rows.append((f"{prefix}.{f.name}", type_text(hints[f.name], f), getattr(defaults, f.name),
                         docs.get(f.name, "")))
    return rows


def _model_subsection(name: str, overrides_cls):
    from hybridtitan.models import GDNArgs, GQAArgs, KDAArgs, Mamba2Args, MLAArgs

    args_cls = {"gdn": GDNArgs, "kda": KDAArgs, "mamba2": Mamba2Args, "mla": MLAArgs, "gqa": GQAArgs}[name]
    docs = _field_docs(args_cls)
    hints = typing.get_type_hints(overrides_cls)
    return [(f"model.{name}.{f.name}", type_text(hints[f.name]), "the flavor's", docs.get(f.name, ""))
            for f in fields(overrides_cls)]


def help_text(usage: str, job_config_cls) -> str:
    """The --help page: ``usage``, then every key of ``job_config_cls`` (hybridtitan.job_config.JobConfig)."""
    out = [usage.rstrip(), "",
           "Every key below can be set in a recipe's [section] or overridden on the command line as",
           "--section.key value (booleans also as --section.flag / --section.no_flag; lists comma-separated).",
           "--job.print_config prints the merged configuration. torchtitan's other options are refused when set.",
           "The defaults are those without a recipe; a recipe (train_configs/*.toml) sets most of them.", ""]
    for section, rows in _entries(job_config_cls):
        out.append(f"[{section}]")
        for key, type_text, default, doc in rows:
            out.append(f"  --{key} ({type_text}; default: {default!r})" if default != "the flavor's"
                       else f"  --{key} ({type_text}; default: the flavor's)")
            for paragraph in doc.splitlines():
                out += textwrap.wrap(paragraph, 112, initial_indent="      ", subsequent_indent="        "
                                     if paragraph.startswith("- ") else "      ")
        out.append("")
    return "\n".join(out)


def reference_markdown(job_config_cls) -> str:
    """docs/config-reference.md: every key hybridtitan reads, a table per section, from the same entries as
    ``help_text`` (so the page cannot drift from the code: a test compares it with this)."""
    out = ["# Configuration reference", "",
           "Every key hybridtitan reads, with its default and meaning: a recipe's `[section]` sets it, the command "
           "line overrides it as `--section.key value` (booleans also `--section.flag` / `--section.no_flag`; lists "
           "comma-separated). torchtitan's other keys are refused when set. Generated from the configuration's "
           "dataclasses by `python -m hybridtitan.describe --config-reference`; a test keeps it current.", ""]
    for section, rows in _entries(job_config_cls):
        out += [f"## [{section}]", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for key, type_text, default, doc in rows:
            shown = "the flavor's" if default == "the flavor's" else f"`{default!r}`"
            cells = [f"`{key}`", type_text, shown, doc.replace("\n", " ")]
            out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        out.append("")
    return "\n".join(out)
