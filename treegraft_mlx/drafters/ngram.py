"""The weak drafter: continuations of n-grams that already occurred in the prompt or output.

Free to run (no model). Its index is incremental: each committed token adds the n-grams that
end at it; nothing is rebuilt per step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterator

from ..history import History
from ..tree import NEG_INF, NGRAM, DraftTree, build_cap


class NgramIndex:
    """End positions of every n-gram (n = 1..n_max) of a growing token sequence."""

    def __init__(self, n_max: int):
        self.n_max = n_max
        self.ends: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self.length = 0
        self.counts: dict[int, int] = defaultdict(int)
        self.most_frequent = -1

    def extend(self, tokens: list[int]) -> None:
        """Index the new tail of the sequence; `tokens` is the whole sequence so far."""
        for p in range(self.length, len(tokens)):
            for n in range(1, min(self.n_max, p + 1) + 1):
                self.ends[tuple(tokens[p - n + 1:p + 1])].append(p)
            t = tokens[p]
            self.counts[t] += 1
            if self.most_frequent < 0 or self.counts[t] > self.counts[self.most_frequent]:
                self.most_frequent = t
        self.length = len(tokens)

    def repeats(self, tokens: list[int]) -> bool:
        """Whether the sequence's last n_max tokens (indexed) occurred earlier: a loop."""
        return len(tokens) >= self.n_max and len(self.ends.get(tuple(tokens[-self.n_max:]), ())) > 1

    def guess(self, tokens: list[int]) -> int:
        """The drafter's top guess for the token after `tokens` (indexed): what followed the
        most recent earlier occurrence of the longest suffix that occurred before; -1 if
        none. A dictionary lookup per n: cheap enough for every plain AR step."""
        last = len(tokens) - 1
        for n in range(min(self.n_max, last), 0, -1):
            ends = self.ends.get(tuple(tokens[-n:]), ())
            earlier = next((e for e in reversed(ends[-2:]) if e < last), -1)
            if earlier >= 0:
                return tokens[earlier + 1]
        return -1

    def occurrences(self, gram: tuple[int, ...]) -> Iterator[int]:
        """End positions of `gram`, most recent first (no copy: callers stop early)."""
        return reversed(self.ends.get(gram, ()))


class NgramDrafter:
    """Context n-gram drafter (the paper's weak drafter W).

    Layer l proposes chains of length max(1, N - (l - 1)), so every chain reaches depth N.
    A parent whose search never finds `top_k` distinct first tokens is terminated.
    """

    name = "ngram"

    def __init__(self, n_max: int = 5, top_k: int = 10, depth: int = 5,
                 max_occurrences: int = 64):
        self.n_max, self.top_k, self.depth = n_max, top_k, depth
        self.max_occurrences = max_occurrences  # per n level, most recent first: bounds the cost
        self.index = NgramIndex(n_max)

    def observe(self, history: History, new_tokens: int) -> None:
        self.index.extend(history.tokens)

    def reset(self) -> None:
        """Forget the indexed sequence (a new prompt that rewrites the history)."""
        self.index = NgramIndex(self.n_max)

    def candidates(self, query: list[int], chain_len: int, tokens: list[int],
                   existing: set[int]) -> tuple[list[tuple[int, int, list[int]]], bool]:
        """(match length, end position, continuation) for one parent, and whether enough
        distinct first tokens were found (False terminates the parent)."""
        found: list[tuple[int, int, list[int]]] = []
        seen: set[tuple[int, ...]] = set()
        firsts = set(existing)
        for n in range(min(self.n_max, len(query)), 0, -1):
            taken = 0
            for end in self.index.occurrences(tuple(query[-n:])):
                if end + 1 >= len(tokens):
                    continue  # nothing follows this occurrence yet
                cont = tokens[end + 1:end + 1 + chain_len]
                key = tuple(cont)
                if key in seen:
                    continue
                seen.add(key)
                found.append((n, end, cont))
                firsts.add(cont[0])
                taken += 1
                if taken >= self.max_occurrences:
                    break
            if len(firsts) >= self.top_k:
                return found, True
        return found, False

    def chosen(self, tree: DraftTree, parent: int, history: History,
               chain_len: int) -> tuple[list[tuple[int, int, list[int]]], bool]:
        """The continuations one frontier parent gets, in insertion order (longer match,
        more recent, smaller first token; at most top_k distinct first tokens), and whether
        enough were found (False terminates the parent)."""
        tokens = history.tokens
        query = tokens[-self.n_max:] + tree.path_tokens(parent)[1:]
        existing = {tree.token[c] for c in tree.children_of(parent)}
        found, enough = self.candidates(query, chain_len, tokens, existing)
        found.sort(key=lambda f: (-f[0], -f[1], f[2][0]))
        firsts, kept = set(existing), []
        for n, end, cont in found:
            if cont[0] not in firsts and len(firsts) >= self.top_k:
                continue
            firsts.add(cont[0])
            kept.append((n, end, cont[:self.depth - tree.depth[parent]]))
        return kept, enough

    def expand(self, tree: DraftTree, frontier: list[int], layer: int, history: History) -> list[int]:
        chain_len = max(1, self.n_max - (layer - 1))
        cap = build_cap(self.top_k, self.depth)
        parents = [p for p in frontier if tree.depth[p] < self.depth]
        chosen = [self.chosen(tree, p, history, chain_len) for p in parents]
        # The target's scores where the matches saw their tokens, in one evaluation.
        history.prefetch([end + j for kept, _ in chosen for _, end, cont in kept
                          for j in range(len(cont))])
        for parent, (kept, enough) in zip(parents, chosen):
            for n, end, cont in kept:
                node = parent
                for j, tok in enumerate(cont):
                    if len(tree) >= cap or tree.depth[node] >= self.depth:
                        break
                    # The target's log-prob of tok where the match saw it (end + j precedes it).
                    lp = history.logprob(end + j)
                    score = tree.score[parent] + lp if j == 0 else NEG_INF
                    node = tree.add(node, tok, score, n, end, ngram_lp=lp, by=NGRAM)
            if not enough:
                tree.terminated[parent] = True
        if layer == 1 and len(tree) == 1 and self.index.most_frequent >= 0:
            # Nothing matched at all: the most frequent context token keeps the tree going.
            return [tree.add(0, self.index.most_frequent, 0.0, by=NGRAM)]
        live = [c for p in frontier if not tree.terminated[p] for c in tree.children_of(p)]
        live.sort(key=lambda i: (-tree.match_len[i], -tree.score[i], i))
        return live if layer == 1 else live[: self.top_k]
