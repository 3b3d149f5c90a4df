import numpy as np

from ctr_foundation.sample import PADDING_FEASIGN
from elastic_control.inference.scoring import InMemoryTable, batch_from_lines, pool


def test_pool_sums_per_slot_in_slot_conf_order_with_padding():
    slots = [3, 1]  # slot.conf order, not numeric order
    batch = batch_from_lines(["1 1 10:1 11:1 12:9", "1 0 20:3"], slots, sparse_dim=None)
    table = InMemoryTable(
        np.array([10, 11, 20, PADDING_FEASIGN], np.uint64), np.array([[1, 2], [10, 20], [100, 200], [7, 7]], np.float32)
    )
    vectors, found = table.lookup(batch.keys)
    emb = pool(batch, vectors)
    # row 0: slot 3 has no feature -> padding key; slot 1 = 10 + 11; slot 9 is not in slot.conf.
    np.testing.assert_array_equal(emb[0], [7, 7, 11, 22])
    np.testing.assert_array_equal(emb[1], [100, 200, 7, 7])
    assert found.all()


def test_missing_keys_give_zero_vectors_and_sparse_dim_applies():
    batch = batch_from_lines(["1 0 1000005:1"], [1], sparse_dim=1000)
    assert batch.keys.tolist() == [5]
    table = InMemoryTable(np.array([6], np.uint64), np.ones((1, 2), np.float32))
    vectors, found = table.lookup(batch.keys)
    assert not found.any()
    np.testing.assert_array_equal(pool(batch, vectors), [[0, 0]])


class _Model:
    """A dense model stand-in: each row's sum (so padding rows are visible if they leak)."""

    def predict(self, x):
        return (x.sum(axis=1) + 1).astype(np.float32)


class _Scorer:
    def __init__(self, scale):
        self.model, self.scale = _Model(), scale

    def model_input(self, batch):
        return (np.asarray(batch, np.float32) * self.scale).reshape(-1, 1)


def test_chunked_scoring_returns_each_batch_whole_in_order_whatever_the_chunk():
    from elastic_control.evaluation.pass_scorer import ChunkedScoring

    rng = np.random.default_rng(3)
    batches = [rng.random(int(n)) for n in (5, 0, 1, 9, 4, 3, 17, 2)]
    for rows in (1, 4, 8, 64):
        scoring = ChunkedScoring([_Scorer(1.0), _Scorer(-2.0)], rows=rows)
        out = []
        for i, b in enumerate(batches):
            out += scoring.add(b, i)
        out += scoring.finish()
        assert [item for item, _ in out] == list(range(len(batches)))
        for (_, (model, baseline)), b in zip(out, batches, strict=True):
            np.testing.assert_array_equal(model, (b.astype(np.float32) + 1).astype(np.float32))
            np.testing.assert_array_equal(baseline, (b.astype(np.float32) * -2 + 1).astype(np.float32))


def test_pass_scorer_lookup_gives_the_tables_vectors():
    from elastic_control.evaluation.pass_scorer import PassScorer

    table = InMemoryTable(np.array([30, 10, 20], np.uint64), np.arange(6, dtype=np.float32).reshape(3, 2))
    scorer = PassScorer.__new__(PassScorer)  # the lookup alone: no pass folder, no dense program
    scorer.table = table
    keys = np.array([10, 5, 30, 31, 20, 10, (1 << 64) - 1], np.uint64)
    np.testing.assert_array_equal(scorer.lookup(keys), table.lookup(keys)[0])
    scorer.table = InMemoryTable(np.zeros(0, np.uint64), np.zeros((0, 2), np.float32))
    np.testing.assert_array_equal(scorer.lookup(keys), np.zeros((len(keys), 2), np.float32))
