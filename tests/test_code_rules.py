"""Rules of the package's code that a reader relies on, read from its source."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hybridtitan"
MAX_POSITIONAL = 7


def _positional(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args if a.arg not in ("self", "cls", "ctx")]


def _exempt(fn: ast.FunctionDef, parents: list[ast.AST]) -> bool:
    """Triton kernels are launched with positional arguments, and autograd.Function.apply passes only positional
    ones to ``forward``."""
    decorators = [ast.unparse(d) for d in fn.decorator_list]
    if any(d.endswith("triton.jit") for d in decorators):
        return True
    owner = parents[-1] if parents else None
    return (fn.name == "forward" and isinstance(owner, ast.ClassDef)
            and any(ast.unparse(b).endswith("autograd.Function") for b in owner.bases))


def test_no_function_takes_more_than_seven_positional_parameters():
    """Beyond the first few, a function's parameters are keyword-only: a call then names what each argument is."""
    found = []

    def visit(node, parents):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                if len(_positional(child)) > MAX_POSITIONAL and not _exempt(child, parents):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{child.lineno} {child.name}")
            visit(child, parents + [child])

    for path in sorted(PACKAGE.rglob("*.py")):
        visit(ast.parse(path.read_text()), [])
    assert not found, "more than 7 positional parameters: " + ", ".join(found)


def test_the_rule_sees_a_long_signature():
    """The check above finds what it looks for (a function of 8 positional parameters) and lets the exemptions be."""
    tree = ast.parse("class F(torch.autograd.Function):\n"
                     "    @staticmethod\n"
                     "    def forward(ctx, a, b, c, d, e, f, g, h): pass\n"
                     "def long(a, b, c, d, e, f, g, h): pass\n"
                     "def fine(a, b, c, d, e, f, g, *, h): pass\n")
    cls, long, fine = tree.body
    assert _exempt(cls.body[0], [cls]) and len(_positional(cls.body[0])) == 8
    assert len(_positional(long)) == 8 and not _exempt(long, [])
    assert len(_positional(fine)) == 7
