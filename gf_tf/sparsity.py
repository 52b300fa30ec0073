"""The CSC names users and tests import, kept at their old place (CSC lives in `gf_tf.csc`)."""

from gf_tf.csc import (AUTO, AUTO_LADDER, DEFAULT_AUTO_BUDGET, DEFAULT_CHUNK_SIZE,  # noqa: F401
                       DEFAULT_DENSITY, DEFAULT_MIN_DENSITY, SELECTIONS, WARMUP_MODES,
                       ChunkSparsity, CSCReducer, CSCSetState, CSCState, choose_rung,
                       select_chunks, selected_chunk_count)
