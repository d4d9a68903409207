"""What a code step's observation is, as the reference's Python tool makes it
(docs/rstar-math.md, "Running a step").

The reference joins the step actions of the open code block, keeps the lines between a line
holding `<code>` and one holding `<end_of_code>` (a line with a tag on it is dropped whole; a
text without a `<code>` line is kept whole), and runs the result in an in-process interpreter:
the program is split at its top-level statements that print (a `print(...)` call, or an `if`,
`for`, `while` or `def` whose body has one); each segment runs with its last statement
evaluated, and shows that value, or what that last statement printed; with several segments,
each output is labelled by the printed expressions. A whole output that reads as a number is
rounded to 4 decimals when that is shorter, and an output over 1,024 characters is cut in the
middle. An exception becomes `ExcType: message`.

`interpreter_program(program, timeout_s)` is a program for the sandbox that does exactly this
with a fresh namespace (the reference shares one interpreter's globals between programs), prints
the observation and exits 1 if the program raised; `reference_program(actions)` is the join.
"""

from __future__ import annotations

from collections.abc import Sequence

from rstar_pipelines.math.steps import CODE_END, CODE_START, STEP_END

# The runner: our code, reproducing the reference tool's behaviour described above.
_RUNNER = r"""
import ast, builtins, io, re, signal, sys
from contextlib import redirect_stdout


def _sanitize(query):
    query = re.sub(r"^(\s|`)*(?i:python)?\s*", "", query)
    return re.sub(r"(\s|`)*$", "", query)


def _prints(node):
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        return isinstance(node.value.func, ast.Name) and node.value.func.id == "print"
    if isinstance(node, (ast.If, ast.While, ast.For, ast.FunctionDef)):
        return any(_prints(child) for child in node.body)
    return False


def _shown(value, limit=1024):
    if isinstance(value, str):
        try:
            rounded = str(round(float(value), 4)) + "\n"
            value = value if len(value) < len(rounded) else rounded
        except Exception:
            pass
    text = str(value)
    return text[: limit // 2] + "..." + text[-(limit // 2):] if len(text) > limit else value


def _segment(body, scope):
    with redirect_stdout(io.StringIO()):  # the reference never shows these prints
        exec(ast.unparse(ast.Module(body[:-1], type_ignores=[])), scope)
    last = ast.unparse(ast.Module(body[-1:], type_ignores=[]))
    buffer = io.StringIO()
    try:
        with redirect_stdout(buffer):
            value = eval(last, scope)
            return _shown(buffer.getvalue() if value is None else value)
    except Exception:
        with redirect_stdout(buffer):
            exec(last, scope)
        return _shown(buffer.getvalue())


def _label(source):
    found = re.findall(r"print\((.*?)\)", source)
    return " ".join(found) + ":" if found else ""


def _alarm(signum, frame):
    message = f"Execution of the code snippet has timed out for exceeding {_SECONDS:g} seconds."
    raise TimeoutError(repr(message))


def _run(query):
    scope = {"__name__": "__interpreter__", "__builtins__": builtins}
    failed = False
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, _SECONDS)
    try:
        query = _sanitize(query)
        body = ast.parse(query).body
        marks = [i for i, node in enumerate(body) if _prints(node)] or [len(body) - 1]
        if len(marks) == 1:
            shown = f"{_segment(body, scope)}"
        else:
            parts = []
            for start, end in zip([-1, *marks], marks):
                source = ast.get_source_segment(query, body[end])
                parts.append(f"{_label(source)} {_segment(body[start + 1:end + 1], scope)}")
            shown = "".join(parts)
    except BaseException as error:
        shown, failed = f"{type(error).__name__}: {error}", True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    sys.stdout.write(shown.strip())
    sys.stdout.flush()
    sys.exit(1 if failed else 0)
"""


def reference_program(actions: Sequence[str]) -> str:
    """The program the reference runs for a step: its open block's actions joined, step markers
    removed, the lines between a `<code>` line and an `<end_of_code>` line (every `<code>` line
    opening a section), or the whole text when there is no `<code>` line."""
    joined = "".join(actions).replace(STEP_END, "")
    program, inside = "", False
    for line in joined.split("\n"):
        if CODE_START in line:
            program += "\n# ========\n"
            inside = True
        elif CODE_END in line:
            inside = False
        elif inside:
            program += line + "\n"
    return (program or joined).strip()


def interpreter_program(program: str, timeout_s: float) -> str:
    """A sandbox job that prints the reference interpreter's observation of `program`, giving up
    after `timeout_s` seconds with the reference's TimeoutError (run it with a longer limit)."""
    return f"{_RUNNER}\n_SECONDS = {float(timeout_s)!r}\n_run({program!r})\n"
