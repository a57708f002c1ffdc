"""TokenTrie: the vocabulary's tokens as a byte trie in flat arrays, for walking a state's mask level by level.

Tokens that share a prefix are walked once: from a structural state (after ``{``, between members) almost every
branch dies in the first byte or two, so a mask costs the few live trie nodes instead of every token. The walk is
vectorised per level: all children of the live frontier take their DFA step in one gather.

Arrays: ``child_start`` [num_nodes + 1] indexes ``child_byte``/``child_node`` (children grouped by parent);
``node_token`` [num_nodes] is the token id that ends at a node (-1 for none); a few vocabularies repeat the same
bytes under several ids, kept in ``duplicate_ids``.
"""

import numpy as np

_NARROW_STATE_BYTES = 32  # states with at most this many live bytes are walked by the scalar (Python) path


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
        # (node << 8 | byte) -> child, for the scalar part of the walk
        self.child_of = dict(zip(((np.asarray(parents[1:]) << 8) | np.asarray(bytes_[1:])).tolist(),
                                 range(1, self.num_nodes)))
        self._node_token_list = node_token
        self._has_children_list = self.has_children.tolist()
        self._child_start_list = self.child_start.tolist()
        self._child_byte_list = self.child_byte.tolist()
        self._child_node_list = self.child_node.tolist()
        self.node_byte = np.asarray(bytes_, dtype=np.int64)  # the byte on the edge into each node (0 at the root)
        self._index_subtrees(parents, node_token, duplicates)

    def _index_subtrees(self, parents: list[int], node_token: list[int], duplicates: dict) -> None:
        """``subtree_ids[subtree_start[n]:subtree_end[n]]`` are the token ids at or below node ``n``. Nodes were
        numbered in preorder (tokens inserted in byte order), so every subtree is one run."""
        num_nodes = self.num_nodes
        depth = [0] * num_nodes
        for node in range(1, num_nodes):
            assert parents[node] < node
            depth[node] = depth[parents[node]] + 1
        ids_at = [([node_token[n]] if node_token[n] >= 0 else []) + duplicates.get(n, []) for n in range(num_nodes)]
        counts = np.asarray([len(ids) for ids in ids_at], dtype=np.int64)
        self.subtree_ids = np.asarray([i for ids in ids_at for i in ids], dtype=np.int64)
        self.subtree_start = np.cumsum(counts) - counts
        # the subtree of n ends where the next node at its depth or above begins (preorder)
        end_node = np.full(num_nodes, num_nodes, dtype=np.int64)
        open_nodes: list[int] = []
        for node in range(num_nodes):
            while open_nodes and depth[open_nodes[-1]] >= depth[node]:
                end_node[open_nodes.pop()] = node
            open_nodes.append(node)
        starts = np.append(self.subtree_start, len(self.subtree_ids))
        self.subtree_end = starts[end_node]
        self.subtree_end_node = end_node  # node ids at or below n are n .. subtree_end_node[n] - 1
        self.depth = np.asarray(depth, dtype=np.int64)

    def subtree_token_ids(self, nodes: np.ndarray) -> np.ndarray:
        return self.subtree_ids[_runs(self.subtree_start[nodes], self.subtree_end[nodes])]

    def children(self, nodes: np.ndarray) -> np.ndarray:
        """The child nodes of ``nodes``, concatenated in node order."""
        return self.child_node[_runs(self.child_start[nodes], self.child_start[nodes + 1])]

    def walk(self, state: int, dfa, pieces=None) -> np.ndarray:
        """Token ids whose bytes, walked from ``state`` of the lazy DFA ``dfa``, never hit a dead move.

        Narrow states (few live bytes: literals, punctuation, whitespace) are followed depth-first in plain
        Python, one dictionary probe per live byte; the subtrees under wide states (string bodies, any byte) are
        then walked level by level, vectorised. Numpy's per-call cost (a few µs) makes the vectorised walk a bad
        deal for a frontier of one or two nodes, which is what literal chains give. ``pieces`` (a TokenIndex)
        resolves whole subtrees that meet a repeat piece from its shared facts (``token_pieces.py``)."""
        child_of, node_token, has_children = self.child_of, self._node_token_list, self._has_children_list
        stack, wide_nodes, wide_states, ids = [(0, state)], [], [], []
        child_start, child_byte, child_node = self._child_start_list, self._child_byte_list, self._child_node_list
        while stack:
            node, current = stack.pop()
            if node and pieces is not None and pieces.piece_split(current) is not None:
                wide_nodes.append(node)
                wide_states.append(current)
                continue
            if node and not dfa.built[current]:
                # below the first byte a node has few children: derive only their bytes, not the whole row
                first, last = child_start[node], child_start[node + 1]
                if last - first > _NARROW_STATE_BYTES:
                    wide_nodes.append(node)
                    wide_states.append(current)
                    continue
                for k in range(first, last):
                    following = dfa.next_state(current, child_byte[k])
                    if following < 0:
                        continue
                    child = child_node[k]
                    if node_token[child] >= 0:
                        ids.append(node_token[child])
                        if child in self.duplicate_ids:
                            ids.extend(self.duplicate_ids[child])
                    if has_children[child]:
                        stack.append((child, following))
                continue
            live = dfa.live_bytes(current)
            if len(live) > _NARROW_STATE_BYTES:
                wide_nodes.append(node)
                wide_states.append(current)
                continue
            row = dfa.trans[current]
            base = node << 8
            for byte in live:
                child = child_of.get(base | byte)
                if child is None:
                    continue
                if node_token[child] >= 0:
                    ids.append(node_token[child])
                    if child in self.duplicate_ids:
                        ids.extend(self.duplicate_ids[child])
                if has_children[child]:
                    stack.append((child, int(row[byte])))
        found = np.asarray(ids, dtype=np.int64)
        if wide_nodes:
            found = np.concatenate([found, self.walk_levels(np.asarray(wide_nodes, dtype=np.int64),
                                                            np.asarray(wide_states, dtype=np.int32), dfa.gather,
                                                            pieces)])
        return found

    def walk_levels(self, nodes: np.ndarray, states: np.ndarray, gather, pieces=None) -> np.ndarray:
        """The vectorised walk below ``nodes`` (in DFA ``states``): one ``gather(states, bytes)`` per trie level."""
        reached, resolved = [], []
        while len(nodes):
            if pieces is not None:
                nodes, states = self._resolve_pieces(nodes, states, pieces, resolved)
            starts, ends = self.child_start[nodes], self.child_start[nodes + 1]
            offsets = _runs(starts, ends)  # every frontier node's children
            if not len(offsets):
                break
            parent_states = np.repeat(states, ends - starts)
            next_states = gather(parent_states, self.child_byte[offsets])
            alive = next_states >= 0
            children, states = self.child_node[offsets[alive]], next_states[alive]
            reached.append(children)
            keep = self.has_children[children]
            nodes, states = children[keep], states[keep]
        ids = self.token_ids_at(np.concatenate(reached)) if reached else np.zeros(0, dtype=np.int64)
        return np.concatenate([ids, *resolved]) if resolved else ids

    def token_ids_at(self, nodes: np.ndarray) -> np.ndarray:
        """The token ids at ``nodes`` (with each node's duplicate tokens)."""
        ids = self.node_token[nodes]
        ids = ids[ids >= 0]
        if len(self.duplicate_nodes):
            extra = nodes[np.isin(nodes, self.duplicate_nodes)]
            if len(extra):
                ids = np.concatenate([ids] + [np.asarray(self.duplicate_ids[int(n)]) for n in extra])
        return ids

    def _resolve_pieces(self, nodes: np.ndarray, states: np.ndarray, pieces, resolved: list):
        """Frontier nodes whose state holds repeat pieces: the pieces' tokens in their subtrees come from the
        shared facts, and the walk goes on in the state of the other members (or stops there)."""
        keep = np.ones(len(nodes), dtype=bool)
        states = states.copy()
        for state in np.unique(states).tolist():
            split = pieces.piece_split(state)
            if split is None:
                continue
            in_state = np.flatnonzero(states == state)
            depths = self.depth[nodes[in_state]]
            exact = True
            for depth in np.unique(depths).tolist():
                ids = self.subtree_token_ids(nodes[in_state[depths == depth]])
                for piece in split[0]:
                    allowed = pieces.piece_subtree_ids(piece, depth, ids)
                    if allowed is None:
                        exact = False
                        break
                    resolved.append(allowed)
                if not exact:
                    break
            if not exact:
                continue  # walk this state plainly; what was resolved is a subset of what the walk finds
            if split[1] < 0:
                keep[in_state] = False
            else:
                states[in_state] = split[1]
        return nodes[keep], states[keep]


def _runs(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The indices ``starts[i] .. ends[i] - 1`` of every run, concatenated: each index is the start of its run
    plus its rank in the run."""
    counts = ends - starts
    return np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
