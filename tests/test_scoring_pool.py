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
