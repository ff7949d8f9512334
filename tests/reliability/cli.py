"""Calling a command-line `main(argv)` in this process the way a user meets it: its exit status and
what it printed on stderr, with any exception that escapes rendered as the traceback a user would see."""

from __future__ import annotations

import contextlib
import io
import traceback


def call_main(main, args: list[str]) -> tuple[object, str]:
    """(exit status, or "exception" if one escaped; stderr text)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:  # noqa: BLE001 - an escaping exception is a traceback for the user
            err.write("".join(traceback.format_exception(exc)))
            code = "exception"
    return code, err.getvalue()


def message(stderr: str, prefix: str) -> str:
    """The command's own message: from its last line starting with `prefix` to the end (one message
    may list several problems on the lines below it); empty if there is none."""
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    return " ".join(lines[starts[-1] :]) if starts else ""


def one_line_problems(
    code, stderr: str, *, exit_code: int, says: tuple[str, ...] = (), never: tuple[str, ...] = ()
) -> tuple[list[str], str]:
    """(what keeps a command's answer from being one clear line, that line): the exit status, a
    traceback anywhere on stderr, what the last line must say and what it must not (a hint that
    cannot help, such as "rerun to resume" for a setup error or damage)."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    problems = [] if code == exit_code else [f"exit {code}, not {exit_code}"]
    if "Traceback (most recent call last)" in stderr:
        problems.append(f"a traceback reached the user: ...{stderr.strip()[-300:]}")
    problems += [f"the line does not say {word!r}: {last[:300]}" for word in says if word not in last]
    problems += [f"the line says {word!r}, which cannot help: {last[:300]}" for word in never if word in last.lower()]
    return problems, last
