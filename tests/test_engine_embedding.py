"""SummedEmbedding's lookup: the forward is `weight[ids]` exactly; the weight gradient (a one-hot matmul over
vocabulary chunks, in a fixed order on every device) equals a float64 numpy scatter-add of the cotangent rows."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import orpo.engine.embedding as embedding
from orpo.engine.embedding import SummedEmbedding, lookup, with_summed_embeddings

# float32 rows summed with float32 accumulation; bf16 cotangents rounded once at the end.
TOL = {mx.float32: 1e-5, mx.bfloat16: 1e-2}


def numpy_rows(cotangent: np.ndarray, ids: np.ndarray, vocab: int) -> np.ndarray:
    out = np.zeros((vocab, cotangent.shape[-1]), np.float64)
    np.add.at(out, ids.reshape(-1), cotangent.reshape(-1, cotangent.shape[-1]).astype(np.float64))
    return out


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_lookup_gradient_is_the_scatter_add_of_the_rows(dtype, compiled, monkeypatch):
    monkeypatch.setattr(embedding, "VOCAB_CHUNK", 16)  # three chunks, the last partial
    rng = np.random.default_rng(0)
    vocab, dims = 40, 8
    ids = rng.integers(0, 6, (3, 50))  # few distinct ids: each repeated ~25 times
    ids[0, :3] = [39, 16, 15]  # the chunks' edges
    weight = mx.array(rng.standard_normal((vocab, dims)), dtype)
    cot = mx.array(rng.standard_normal((3, 50, dims)), dtype)
    ids_mx = mx.array(ids)

    def grad(w, c):
        return mx.vjp(lambda w: lookup(w, ids_mx), [w], [c])[1][0]

    got = (mx.compile(grad) if compiled else grad)(weight, cot)
    assert got.dtype == dtype and got.shape == (vocab, dims)
    got = np.array(got.astype(mx.float32))
    want = numpy_rows(np.array(cot.astype(mx.float32)), ids, vocab)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= TOL[dtype] * scale
    assert np.all(got[[i for i in range(vocab) if i not in ids]] == 0)  # untouched rows are zero
    assert mx.array_equal(lookup(weight, ids_mx), weight[ids_mx]).item()


def test_only_trainable_embeddings_are_swapped_and_keep_their_weight():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.frozen = nn.Embedding(10, 4)
            self.proj = nn.Linear(4, 4)

    model = Model()
    model.frozen.freeze()
    weight = model.embed.weight
    assert with_summed_embeddings(model) == ["embed"]
    assert type(model.embed) is SummedEmbedding and model.embed.weight is weight
    assert type(model.frozen) is nn.Embedding
    ids = mx.array([[1, 1, 3]])
    assert np.array_equal(np.array(model.embed(ids)), np.array(weight[ids]))
    assert np.array_equal(np.array(model.embed.as_linear(mx.ones((1, 4)))), np.array(mx.ones((1, 4)) @ weight.T))
