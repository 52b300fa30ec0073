"""selection="global": one top K over the chunks of all packs of one wire group.

K = max(1, ceil(density * C)) over the C chunks of all packs of one wire dtype (GradientFlow's
whole-model importance); each pack sends its share of those K chunks, a number that changes
from step to step (`gf_tf.csc.selection.group_shares`). The top K needs every pack's norms,
so the packs never split into overlap groups.
"""

from gf_tf.csc.selection import SelectionPolicy


class GlobalSelection(SelectionPolicy):
    """selection="global": one top K over the chunks of all packs of one wire group."""
    name = "global"
    groupable = False

    def competing(self, counts, members):
        """Per member pack, the chunks its k is taken over: the whole group's."""
        total = sum(counts[j] for j in members)
        return [total] * len(members)

    def group_top_k(self, ks, members):
        """The group's K (each member's k is it), or None when K covers the group whole."""
        return ks[members[0]]
