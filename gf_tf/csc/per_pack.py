"""selection="per_pack": each pack sends its own top k of its C_p chunks (the default).

k = max(1, ceil(density * C_p)) chunks of every pack, chosen from this step's all-reduced
chunk norms (`gf_tf.csc.selection.select_chunks`), so every pack is represented every step
and a group of packs can select and send on its own (overlap).
"""

from gf_tf.csc.selection import SelectionPolicy


class PerPackSelection(SelectionPolicy):
    """selection="per_pack": each pack sends its own top k of its C_p chunks."""
    name = "per_pack"

    def competing(self, counts, members):
        """Per member pack, the chunks its k is taken over: its own."""
        return [counts[j] for j in members]

    def group_top_k(self, ks, members):
        """The K of one top K over the group's chunks: none here (each pack its own)."""
        return None
