"""What SGLang's radix cache would hold: the token sequences this engine has computed (each finished request's input
and output), so a request reports in `meta_info.cached_tokens` how much of its prompt was computed before, as SGLang
does. The CPU engine still computes every prompt in full: the index counts prefix hits, it reuses no KV.
"""

from __future__ import annotations

DEFAULT_MAX_TOKENS = 1 << 17  # tokens held before the index starts afresh (SGLang evicts; a CPU engine's is small)


class PrefixIndex:
    """A token trie of computed sequences, for one weight version (new weights compute new KV: it starts afresh)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.version: str | None = None
        self._root: dict[int, dict] = {}
        self.num_tokens = 0

    def clear(self) -> None:
        self._root, self.num_tokens = {}, 0

    def _at(self, version: str) -> None:
        if version != self.version:
            self.clear()
            self.version = version

    def match(self, input_ids: list[int], version: str) -> int:
        """How many leading tokens of `input_ids` were computed under `version`; at most len - 1, as SGLang always
        computes a prompt's last token."""
        self._at(version)
        node, matched = self._root, 0
        for token in input_ids[:-1]:
            node = node.get(token)
            if node is None:
                break
            matched += 1
        return matched

    def insert(self, token_ids: list[int], version: str) -> None:
        """Record a computed sequence (a finished request's input and the output tokens fed back)."""
        self._at(version)
        node = self._root
        for token in token_ids:
            child = node.get(token)
            if child is None:
                if self.num_tokens >= self.max_tokens:  # full: start afresh with this sequence
                    self.clear()
                    self.insert(token_ids, version)
                    return
                child = node[token] = {}
                self.num_tokens += 1
            node = child
