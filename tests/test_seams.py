"""The seams of the house: a reducer, a wire format and a collective algorithm added from outside
gf_tf/ (tests/workers/extension_worker.py), each through a 2-worker all-reduce checked against
the float64 NumPy sum. No file in gf_tf/ names them."""

import pathlib

import numpy as np
import pytest

import cluster

STEPS, VARIABLES = 2, 3
NAMES = ("SendEverything", "fp32_alias", "ring_alias")


def run(extension):
    results = cluster.run_workers("extension_worker.py", 2, ["--extension", extension,
                                                             "--steps", str(STEPS)],
                                  timeout=150, comm_timeout=30)
    assert all(r.ok for r in results), cluster.describe(results)
    return [r.result for r in results]


def reference(results, step, i):
    return sum(r[f"g{step}_{i}"].astype(np.float64) for r in results)


def assert_sums(results, rtol, atol):
    for step in range(STEPS):
        for i in range(VARIABLES):
            want = reference(results, step, i)
            for r in results:
                np.testing.assert_allclose(r[f"out{step}_{i}"], want, rtol=rtol, atol=atol)
            assert results[0][f"out{step}_{i}"].tobytes() == results[1][f"out{step}_{i}"].tobytes()


@pytest.mark.slow   # 2 worker processes
def test_a_reducer_of_our_own_sums_float32_exactly():
    results = run("reducer")
    assert_sums(results, rtol=1e-6, atol=1e-6)
    assert set(results[0]["collective_dtypes"]) == {"float32"}


@pytest.mark.slow   # 2 worker processes
def test_a_wire_format_registered_outside_travels_as_its_dtype():
    results = run("wire")
    assert_sums(results, rtol=1e-6, atol=1e-6)
    assert "fp32_alias packs" in results[0]["plans"][0], results[0]["plans"]
    assert set(results[0]["collective_dtypes"]) == {"float32"}


@pytest.mark.slow   # 2 worker processes
def test_an_algorithm_registered_outside_carries_fp16_packs():
    results = run("algorithm")
    assert_sums(results, rtol=2e-3, atol=2e-3)   # FP16 wire: 11 significant bits
    assert "float16" in set(results[0]["collective_dtypes"])
    assert "ring alias" in results[0]["plans"][0], results[0]["plans"]


def test_no_file_in_gf_tf_names_the_extensions():
    package = pathlib.Path(__file__).resolve().parent.parent / "gf_tf"
    for path in package.rglob("*.py"):
        text = path.read_text()
        assert not [name for name in NAMES if name in text], path


def test_the_handshake_names_a_reducer_by_its_class_where_the_class_is_loaded():
    """The handshake's reducer row, printed from the number the table carries: the class name of
    any loaded Reducer (gf_tf's and one of our own), and the CRC32 of the name for a class this
    worker never loaded (a peer's own)."""
    import zlib
    from gf_tf import route
    from gf_tf.plan import Forecast, Plan, Planned
    from gf_tf.reducers import DenseReducer, LowRank
    from test_reducer_checkpoint import RoundingWithFeedback
    planned = Planned(Plan("fp16", 0, "ring"), Forecast())

    def row(reducer):
        ((_, code, show),) = [s for s in route.settings((), planned, reducer) if s[0] == "reducer"]
        return float(code), show

    reducers = [DenseReducer(), LowRank(), RoundingWithFeedback()]
    shown = [show(code) for code, show in map(row, reducers)]
    assert shown == ["DenseReducer", "LowRank", "RoundingWithFeedback"]
    _, show = row(LowRank())
    peers_own = zlib.crc32(b"APeersOwnReducer")
    assert show(float(peers_own)) == f"{peers_own:08x} (CRC32 of a class name not loaded here)"
