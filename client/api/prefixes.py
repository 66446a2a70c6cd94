"""A radix tree over token ids: which of the sequences it holds shares the longest prefix with a new one.

The gateway indexes the sessions it keeps open by the tokens their caches hold (`client.api.reuse`); a new
prompt walks the tree once, in time linear in the prompt, whatever the number of sessions. Each edge is a
run of tokens; a node lists the items whose sequence passes through it, so the deepest node a prompt
reaches names the items that share that much of it. Pure: no networking, no clock.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    edge: tuple[int, ...] = ()  # the tokens from the parent to this node
    children: dict[int, _Node] = field(default_factory=dict)  # by the first token of their edge
    items: set = field(default_factory=set)  # items whose sequence passes through (or ends at) this node


class PrefixTree:
    """`insert(item, tokens)`, `remove(item)`, `longest(tokens) -> (items, length)`."""

    def __init__(self):
        self.root = _Node()
        self.sequences: dict[Hashable, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self.sequences)

    def insert(self, item: Hashable, tokens: Sequence[int]) -> None:
        if item in self.sequences:
            self.remove(item)
        tokens = tuple(tokens)
        self.sequences[item] = tokens
        node, i = self.root, 0
        node.items.add(item)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                node.children[tokens[i]] = child = _Node(tokens[i:])
                child.items.add(item)
                return
            same = _common(child.edge, tokens, i)
            if same < len(child.edge):  # split the edge where the new sequence leaves it
                middle = _Node(child.edge[:same], items=set(child.items))
                child.edge = child.edge[same:]
                middle.children[child.edge[0]] = child
                node.children[tokens[i]] = child = middle
            child.items.add(item)
            node, i = child, i + same

    def remove(self, item: Hashable) -> None:
        tokens = self.sequences.pop(item, None)
        if tokens is None:
            return
        node, i = self.root, 0
        node.items.discard(item)
        while i < len(tokens):
            child = node.children[tokens[i]]
            child.items.discard(item)
            if not child.items:
                del node.children[tokens[i]]  # nothing else passes here: the whole branch goes
                return
            if len(child.children) == 1 and not _ends_at(child, self.sequences, i + len(child.edge)):
                (only,) = child.children.values()  # merge a node left with one child back into its edge
                only.edge = child.edge + only.edge
                node.children[tokens[i]] = only
                continue  # the merged node is visited next, from the same parent
            node, i = child, i + len(child.edge)

    def longest(self, tokens: Sequence[int]) -> tuple[set, int]:
        """The items sharing the longest prefix with `tokens`, and its length (0 and every item if none)."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            same = _common(child.edge, tokens, i)
            if same < len(child.edge):
                return set(child.items), i + same
            node, i = child, i + same
        return set(node.items), i


def _common(edge: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """How many tokens of `edge` match `tokens` from `start`."""
    n = min(len(edge), len(tokens) - start)
    for k in range(n):
        if edge[k] != tokens[start + k]:
            return k
    return n


def _ends_at(node: _Node, sequences: dict, depth: int) -> bool:
    """Whether some item's sequence ends exactly at `node` (at `depth` tokens)."""
    return any(len(sequences[item]) == depth for item in node.items)
