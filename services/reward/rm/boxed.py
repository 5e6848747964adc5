"""The last \\boxed{...} of a text, with the two extraction rules slime's reward models use."""

from __future__ import annotations


def balanced_from(text: str, start: int) -> str | None:
    """text[start:] up to the brace that closes the first one opened after start; None if none closes."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def last_boxed_command(text: str, *, fbox: bool = True) -> str | None:
    """The last "\\boxed..." command with its braced argument ("\\fbox" when there is no \\boxed and fbox)."""
    start = text.rfind("\\boxed")
    if start < 0 and fbox:
        start = text.rfind("\\fbox")
    return None if start < 0 else balanced_from(text, start)


def unbox(command: str | None) -> str | None:
    """The argument of "\\boxed{...}"; None for anything else (an \\fbox, a "\\boxed 5", a missing command)."""
    prefix = "\\boxed{"
    if command is None or not command.startswith(prefix) or not command.endswith("}"):
        return None
    return command[len(prefix):-1]


def boxed_answer(text: str) -> str | None:
    """slime's `extract_answer`: the last \\boxed{} content, only when the text contains "\\boxed" at all."""
    return unbox(last_boxed_command(text)) if "\\boxed" in text else None
