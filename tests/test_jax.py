"""neoflow.jax: a tensor expression as a jax.custom_vjp function (jit, grad, vmap)."""

from __future__ import annotations

import numpy as np
import pytest

import neoflow

jax = pytest.importorskip("jax")
jnp = jax.numpy
nj = pytest.importorskip("neoflow.jax")

CAPSULE = "Out[b, k, p, q, i, j] = ReduceAdd({c, r, s, t}, In[b, c, p*2 + r, q*2 + s, i, t] * W[k, c, r, s, t, j])"


def capsule_jnp(x: jax.Array, w: jax.Array) -> jax.Array:
    """The stride-2 capsule convolution in jnp: strided slices of the 3x3 window, then einsum."""
    size = (x.shape[2] - 3) // 2 + 1
    rows = [jnp.stack([x[:, :, r : r + 2 * size : 2, s : s + 2 * size : 2] for s in range(3)]) for r in range(3)]
    return jnp.einsum("rsbcpqit,kcrstj->bkpqij", jnp.stack(rows), w)


def _arrays() -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.standard_normal((2, 3, 9, 9, 2, 2)), jnp.float32),
        jnp.asarray(rng.standard_normal((4, 3, 3, 3, 2, 2)), jnp.float32),
    )


def test_forward_and_grad_under_jit_match_jnp() -> None:
    caps = nj.op(CAPSULE)
    assert caps.inputs == ["In", "W"]
    x, w = _arrays()
    np.testing.assert_allclose(caps(x, w), capsule_jnp(x, w), rtol=1e-5, atol=1e-5)

    def loss(f):
        return lambda a, b: jnp.sum(jnp.tanh(f(a, b)) ** 2)

    ours = jax.jit(jax.value_and_grad(loss(caps), argnums=(0, 1)))(x, w)
    theirs = jax.value_and_grad(loss(capsule_jnp), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5)
    for got, want in zip(ours[1], theirs[1], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_only_the_gradients_asked_for_and_names_and_vmap() -> None:
    matmul = nj.op("Y[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])")
    a, b = jnp.ones((3, 4)), jnp.arange(8.0).reshape(4, 2)
    np.testing.assert_allclose(matmul(B=b, A=a), a @ b)
    grad_b = jax.grad(lambda bb: matmul(a, bb).sum())(b)
    np.testing.assert_allclose(grad_b, jnp.full((4, 2), 3.0))
    batched = jax.vmap(lambda aa: matmul(aa, b))(jnp.stack([a, 2 * a]))
    np.testing.assert_allclose(batched[1], 2 * a @ b)


def test_integer_inputs_get_no_gradient() -> None:
    gather = nj.op("Y[i, j] = X[Idx[i], j]")
    x = jnp.arange(12.0).reshape(6, 2)
    index = jnp.array([4, 0, 4], jnp.int32)
    np.testing.assert_allclose(gather(x, index), x[index])
    grad = jax.grad(lambda xx: gather(xx, index).sum())(x)
    np.testing.assert_allclose(grad, jnp.zeros((6, 2)).at[index].add(1.0))


def test_bad_calls_are_neoflow_errors() -> None:
    caps = nj.op(CAPSULE)
    x, w = _arrays()
    with pytest.raises(neoflow.InputError, match="missing input 'W'"):
        caps(x)
    with pytest.raises(neoflow.InputError, match="mix dtypes"):
        caps(x, w.astype(jnp.float16))
