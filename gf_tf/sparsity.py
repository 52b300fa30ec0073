"""Deprecated: gf_tf.sparsity moved to gf_tf.csc (gf_tf.ChunkSparsity); this name keeps working with a DeprecationWarning."""

import warnings

from gf_tf.csc import (AUTO, AUTO_LADDER, DEFAULT_AUTO_BUDGET, DEFAULT_CHUNK_SIZE,  # noqa: F401
                       DEFAULT_DENSITY, DEFAULT_MIN_DENSITY, SELECTIONS, WARMUP_MODES,
                       ChunkSparsity, CSCReducer, CSCSetState, CSCState, choose_rung,
                       select_chunks, selected_chunk_count)

warnings.warn("gf_tf.sparsity is deprecated: import from gf_tf.csc (gf_tf.ChunkSparsity)", DeprecationWarning, stacklevel=2)
