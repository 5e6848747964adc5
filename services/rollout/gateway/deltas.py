"""A streamed turn's content as deltas: from the cumulative text the engine has produced so far, the part that is
sure to begin the turn's final content (what the non-streamed answer holds), so that the deltas joined equal it.
Held back until the text settles: outer whitespace, a possible stop string or `<tool_call>` still being written, an
unfinished character. Knows nothing of either API's wire shape.
"""

from __future__ import annotations

TOOL_CALL_OPEN = "<tool_call>"


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ContentDeltas:
    """Feed it the cumulative decoded text; it returns what content to send now (possibly "")."""

    def __init__(self, stop: list[str], with_tools: bool) -> None:
        self.markers = [s for s in stop if s] + ([TOOL_CALL_OPEN] if with_tools else [])
        self.sent = ""

    def settled(self, text: str) -> str:
        """The prefix of `text` that no later token can change in the final content, outer whitespace removed."""
        end = len(text)
        for marker in self.markers:
            found = text.find(marker)
            end = min(end, found if found >= 0 else len(text) - _partial_suffix(text, marker))
        text = text[:end]
        if text.endswith("\ufffd"):  # a character whose bytes are not all generated yet
            text = text.rstrip("\ufffd")
        return text.strip()

    def update(self, text: str) -> str:
        settled = self.settled(text)
        if len(settled) <= len(self.sent) or not settled.startswith(self.sent):
            return ""
        delta, self.sent = settled[len(self.sent):], settled
        return delta

    def finish(self, content: str) -> str:
        """The rest of the final content; "" if what was sent is not its beginning (it always should be)."""
        if not content.startswith(self.sent):
            return ""
        delta, self.sent = content[len(self.sent):], content
        return delta
