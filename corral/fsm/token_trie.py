"""TokenTrie: the vocabulary's tokens as a byte trie in flat arrays, for walking a state's mask level by level.

Tokens that share a prefix are walked once: from a structural state (after ``{``, between members) almost every
branch dies in the first byte or two, so a mask costs the few live trie nodes instead of every token. The walk is
vectorised per level: all children of the live frontier take their DFA step in one gather.

Arrays: ``child_start`` [num_nodes + 1] indexes ``child_byte``/``child_node`` (children grouped by parent);
``node_token`` [num_nodes] is the token id that ends at a node (-1 for none); a few vocabularies repeat the same
bytes under several ids, kept in ``duplicate_ids``.
"""

import numpy as np


class TokenTrie:
    def __init__(self, token_bytes: tuple[bytes, ...], token_ids: np.ndarray):
        prefixes: dict[bytes, int] = {b"": 0}
        parents, bytes_, node_token, duplicates = [-1], [0], [-1], {}
        for token_id in sorted(token_ids.tolist(), key=token_bytes.__getitem__):
            data = token_bytes[token_id]
            for end in range(1, len(data) + 1):
                prefix = data[:end]
                if prefix not in prefixes:
                    prefixes[prefix] = len(parents)
                    parents.append(prefixes[data[:end - 1]])
                    bytes_.append(data[end - 1])
                    node_token.append(-1)
            node = prefixes[data]
            if node_token[node] < 0:
                node_token[node] = token_id
            else:
                duplicates.setdefault(node, []).append(token_id)
        parents_arr = np.asarray(parents[1:], dtype=np.int64)
        order = np.argsort(parents_arr, kind="stable")
        self.num_nodes = len(parents)
        self.child_node = (order + 1).astype(np.int64)
        self.child_byte = np.asarray(bytes_[1:], dtype=np.int64)[order]
        self.child_start = np.searchsorted(parents_arr[order], np.arange(self.num_nodes + 1))
        self.has_children = self.child_start[1:] > self.child_start[:-1]
        self.node_token = np.asarray(node_token, dtype=np.int64)
        self.duplicate_nodes = np.asarray(sorted(duplicates), dtype=np.int64)
        self.duplicate_ids = duplicates

    def walk(self, state: int, ensure) -> np.ndarray:
        """Token ids whose bytes, walked from DFA ``state``, never hit a dead move. ``ensure(states)`` returns the
        transition table with the rows of ``states`` built."""
        nodes = np.zeros(1, dtype=np.int64)
        states = np.full(1, state, dtype=np.int32)
        reached = []
        while len(nodes):
            starts = self.child_start[nodes]
            counts = self.child_start[nodes + 1] - starts
            total = int(counts.sum())
            if total == 0:
                break
            # children of every frontier node, flattened: index = start of its parent's run + rank in the run
            offsets = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(total)
            parent_states = np.repeat(states, counts)
            next_states = ensure(states)[parent_states, self.child_byte[offsets]]
            alive = next_states >= 0
            children, states = self.child_node[offsets[alive]], next_states[alive]
            reached.append(children)
            keep = self.has_children[children]
            nodes, states = children[keep], states[keep]
        if not reached:
            return np.zeros(0, dtype=np.int64)
        reached_nodes = np.concatenate(reached)
        ids = self.node_token[reached_nodes]
        ids = ids[ids >= 0]
        if len(self.duplicate_nodes):
            extra = reached_nodes[np.isin(reached_nodes, self.duplicate_nodes)]
            if len(extra):
                ids = np.concatenate([ids] + [np.asarray(self.duplicate_ids[int(n)]) for n in extra])
        return ids
