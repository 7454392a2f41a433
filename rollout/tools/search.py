"""`search`: BM25 retrieval over a small local corpus, by the bm25s library (sparse BM25, numpy only).

The default corpus is the built-in fictional town facts (`slime_dsa.data.facts`), which the `fact_lookup` task asks
about. The index is built once per tool; a query returns the `k` best documents, one a line (default 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import bm25s

MAX_K = 5


class Search:
    """The search tool over `documents` (default: the built-in fact corpus)."""

    name = "search"
    description = "Search the reference documents; returns the best matching document(s)."
    parameters: dict[str, Any] = {"type": "object", "required": ["query"],
                                  "properties": {"query": {"type": "string", "description": "what to look for"},
                                                 "k": {"type": "integer", "description": f"documents to return, 1-{MAX_K}"}}}

    def __init__(self, documents: Sequence[str] | None = None) -> None:
        if documents is None:
            from slime_dsa.data.facts import documents as fact_documents  # noqa: PLC0415

            documents = fact_documents()
        if not documents:
            raise ValueError("search needs at least one document")
        self.documents = list(documents)
        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenize(self.documents, show_progress=False), show_progress=False)

    def search(self, query: str, k: int = 1) -> list[str]:
        """The `k` best documents for `query`, best first (those that share no term with it are left out)."""
        k = max(1, min(int(k), MAX_K, len(self.documents)))
        tokens = bm25s.tokenize([query], show_progress=False)
        if not tokens.vocab:
            return []
        ids, scores = self.index.retrieve(tokens, k=k, show_progress=False)
        return [self.documents[int(i)] for i, s in zip(ids[0], scores[0]) if s > 0]

    async def call(self, query: str, k: str | int = 1) -> str:
        hits = self.search(query, int(k))
        return "\n".join(hits) if hits else "no document matches the query"
