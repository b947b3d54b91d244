"""neoflow's cuda target against PyTorch eager, torch.compile and cuBLAS on one GPU, in one process.

    python -m benchmarks.gpu [--quick] [--out benchmarks/gpu_results]

Each system's time is the median over ``--rounds`` rounds of a block of ``--block``
consecutive calls timed with CUDA events (the systems take turns round by round);
neoflow's call is one replay of the CUDA graph of its kernels, PyTorch's the eager
(or compiled) forward and backward.  Outputs are checked against PyTorch before any
timing counts.  Also writes the tensor-core model's predicted time of every kernel
next to its measured time (``--kernels``) for the model's rank correlation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

import neoflow
from neoflow.ir.graph import Graph
from neoflow.targets.cuda.executor import CudaExecutor
from neoflow.targets.cuda.timing import predict_kernel


def _torch():
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks.gpu needs a CUDA GPU and PyTorch built for it")
    return torch


def torch_block(fn, block: int) -> float:
    """Seconds a call of ``fn`` takes, from CUDA events around ``block`` calls in a row."""
    torch = _torch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(block):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / block


def neoflow_block(executor: CudaExecutor, block: int) -> float:
    """Seconds a replay of ``executor``'s CUDA graph takes, from CUDA events around each of ``block``
    replays (the executor has run once, so its graph is captured and its inputs are on the GPU)."""
    from neoflow.targets.cuda import driver

    return sum(driver.time_replays(executor.replay_graph, block)) / block


def medians(systems: dict, rounds: int) -> dict[str, float]:
    """Each system's median block time over ``rounds`` rounds taking turns (after a warm-up round)."""
    for fn in systems.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(rounds):
        for name, fn in systems.items():
            times[name].append(fn())
    return {name: statistics.median(values) for name, values in times.items()}


def tuned_executor(executor: CudaExecutor, budget: float, feed) -> CudaExecutor | None:
    """``executor``'s graph planned again after ``neoflow tune``'s cuda tuner timed its tensor-core
    pieces (within ``budget`` seconds; None where ``budget`` is 0), run once on ``feed``."""
    if budget <= 0:
        return None
    from neoflow.targets.cuda import tuner

    tuner.tune_graph(executor, feed, tuner.tensor_core_ops(executor.graph, executor.precision, executor.arch), budget)
    tuned = CudaExecutor(executor.graph, executor.keep, precision=executor.precision, arch=executor.arch)
    tuned.run(feed)
    return tuned


def capsule_case(stride: int, precision: str, rounds: int, block: int, tune: float = 0.0) -> dict:
    """The capsule conv (N=16, C=K=32, 14x14 output, 3x3, 4x4 poses) forward and backward (with
    ``tune`` seconds: also after tuning its kernels on the GPU)."""
    torch = _torch()
    size = 13 * stride + 3
    dtype_name = "float16" if precision == "fp16" else "float32"  # fp16: half tensors, as PyTorch's
    op = neoflow.op(
        f"Out[b, k, p, q, i, j] = ReduceAdd({{c, r, s, t}}, In[b, c, p*{stride} + r, q*{stride} + s, i, t] * "
        "W[k, c, r, s, t, j])",
        shapes={"In": (16, 32, size, size, 4, 4), "W": (32, 32, 3, 3, 4, 4)},
        dtype=dtype_name,
    )
    adjoints = neoflow.grad(op)
    graph = Graph.from_ops([op, *adjoints.values()], outputs=[op.name, *(a.name for a in adjoints.values())])
    rng = np.random.default_rng(0)
    inputs = {t.name: rng.standard_normal(t.shape).astype(dtype_name) for t in graph.inputs}
    executor = CudaExecutor(graph, graph.outputs, precision=precision)
    outputs = executor.run(inputs)
    dtype = torch.float16 if precision == "fp16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    x = torch.tensor(inputs["In"], device="cuda", dtype=dtype, requires_grad=True)
    w = torch.tensor(inputs["W"], device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.tensor(inputs["dOut"], device="cuda", dtype=dtype)

    def capsule(x, w):
        patches = x.unfold(2, 3, stride).unfold(3, 3, stride)  # b c p q i t r s
        return torch.einsum("bcpqitrs,kcrstj->bkpqij", patches, w)

    def eager():
        x.grad = w.grad = None
        capsule(x, w).backward(dout)

    compiled_fn = torch.compile(capsule)

    def compiled():
        x.grad = w.grad = None
        compiled_fn(x, w).backward(dout)

    eager()
    reference = {"Out": capsule(x, w).detach().float().cpu().numpy(), "dIn": x.grad.float().cpu().numpy()}
    reference["dW"] = w.grad.float().cpu().numpy()
    errors = {
        name: float(np.abs(outputs[name] - reference[name]).max() / np.abs(reference[name]).max()) for name in reference
    }
    m, n, k = 16 * 14 * 14 * 4, 128, 32 * 9 * 4
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    c = torch.randn(m, n, device="cuda", dtype=dtype)

    def gemms():  # the same work as three matrix products (implicit GEMM view)
        a @ b
        c @ b.T
        a.T @ c

    systems = {
        "neoflow": lambda: neoflow_block(executor, block),
        "torch eager": lambda: torch_block(eager, block),
        "torch.compile": lambda: torch_block(compiled, block),
        "3 cuBLAS GEMMs": lambda: torch_block(gemms, block),
    }
    tuned = tuned_executor(executor, tune, inputs)
    if tuned is not None:
        found = tuned.run(inputs)
        errors |= {
            f"{name} tuned": float(np.abs(found[name] - reference[name]).max() / np.abs(reference[name]).max())
            for name in reference
        }
        systems["neoflow tuned"] = lambda: neoflow_block(tuned, block)
    times = medians(systems, rounds)
    kernels = _kernel_rows(executor, inputs)
    return {"case": f"capsule stride {stride} {precision}", "times": times, "errors": errors, "kernels": kernels}


def _kernel_rows(executor: CudaExecutor, inputs) -> list[tuple[str, float, float]]:
    """Per op of ``executor``: name, predicted and measured seconds of its kernels (each op alone in a
    graph, on the values the whole graph computed before it)."""
    everything = [t.name for t in executor.graph.inputs] + [op.name for op in executor.graph.ops]
    inputs = CudaExecutor(executor.graph, everything, precision=executor.precision).run(inputs)
    rows = []
    for plan in executor.plans.values():
        single = Graph.from_ops([plan.op])
        alone = CudaExecutor(single, [plan.op.name], precision=executor.precision)
        feed = {t.name: inputs[t.name] for t in single.inputs}
        measured = statistics.median(alone.time(feed, 20))
        predicted = sum(predict_kernel(k) for k in plan.kernels)
        rows.append((plan.op.name, predicted, measured))
    return rows


def operator_case(operator, rounds: int, block: int) -> dict:
    """One operator of the suite (``gpu_ops``), forward and backward in tf32, against PyTorch eager
    (cuBLAS/cuDNN, TF32 allowed)."""
    torch = _torch()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    op = neoflow.op(operator.text, shapes=operator.shapes, out_shape=operator.out_shape)
    adjoints = neoflow.grad(op)
    graph = Graph.from_ops([op, *adjoints.values()], outputs=[op.name, *(a.name for a in adjoints.values())])
    rng = np.random.default_rng(0)
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in graph.inputs}
    executor = CudaExecutor(graph, graph.outputs, precision="tf32")
    outputs = executor.run(inputs)
    tensors = {name: torch.tensor(inputs[name], device="cuda", requires_grad=True) for name in operator.shapes}
    dout = torch.tensor(inputs[f"d{op.name}"], device="cuda")

    def eager():
        for tensor in tensors.values():
            tensor.grad = None
        operator.torch(tensors).backward(dout)

    eager()
    reference = {op.name: operator.torch(tensors).detach().cpu().numpy()}
    reference |= {adjoints[name].name: tensor.grad.cpu().numpy() for name, tensor in tensors.items()}
    errors = {
        name: float(np.abs(outputs[name] - value).max() / max(np.abs(value).max(), 1e-30))
        for name, value in reference.items()
    }
    times = medians(
        {"neoflow": lambda: neoflow_block(executor, block), "torch eager": lambda: torch_block(eager, block)}, rounds
    )
    return {"case": operator.name, "times": times, "errors": errors, "kernels": _kernel_rows(executor, inputs)}


def _capsule_conv_torch(x, k, stride: int):
    """``Out[b,k,p,q,i,j] = sum_{c,r,s,t} x[b,c,p*stride+r,q*stride+s,i,t] * k[k,c,r,s,t,j]`` (unfold + einsum)."""
    patches = x.unfold(2, 3, stride).unfold(3, 3, stride)  # b c p q i t r s
    return _torch().einsum("bcpqitrs,kcrstj->bkpqij", patches, k)


def _capsule_conv_jax(x, k, stride: int):
    import jax.numpy as jnp

    p = (x.shape[2] - 3) // stride + 1
    q = (x.shape[3] - 3) // stride + 1
    out = 0
    for r in range(3):
        for s in range(3):
            window = x[:, :, r : r + stride * (p - 1) + 1 : stride, s : s + stride * (q - 1) + 1 : stride]
            out = out + jnp.einsum("bcpqit,kctj->bkpqij", window, k[:, :, r, s])
    return out


def capsule_network_case(rounds: int, block: int, tune: float = 0.0) -> dict:
    """The training step (cross-entropy, SGD) of ``models/capsule28.onnx`` (batch 64, 28x28, two
    capsule-conv layers), compiled with the neoflow fusion policy, against PyTorch eager and JAX jit."""
    import jax
    import jax.numpy as jnp

    torch = _torch()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    lr = 0.01
    path = Path(__file__).resolve().parents[1] / "models" / "capsule28.onnx"
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd", lr=lr)
    model = neoflow.compile(path, target="cuda", train=spec, fusion="neoflow")
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((64, 1, 28, 28)).astype(np.float32), "y": rng.integers(0, 10, 64)}
    start = {name: value.copy() for name, value in model.parameters().items()}
    losses = [model.train_step(batch) for _ in range(3)]
    executor, feed = model.executor_and_feed(batch, True)

    params = {name: torch.tensor(value, device="cuda", requires_grad=True) for name, value in start.items()}
    x = torch.tensor(batch["x"], device="cuda")
    y = torch.tensor(batch["y"], device="cuda")
    optimizer = torch.optim.SGD(params.values(), lr=lr)

    def torch_forward(p, x):
        h = torch.relu(_capsule_conv_torch(x.reshape(64, 1, 28, 28, 1, 1), p["k1"], 1))
        return _capsule_conv_torch(h, p["k2"], 2).flatten(1) @ p["w"].T + p["b"]

    def torch_step():
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(torch_forward(params, x), y)
        loss.backward()
        optimizer.step()
        return loss

    torch_losses = [float(torch_step()) for _ in range(3)]

    def jax_loss(p, x, y):
        h = jax.nn.relu(_capsule_conv_jax(x.reshape(64, 1, 28, 28, 1, 1), p["k1"], 1))
        logits = _capsule_conv_jax(h, p["k2"], 2).reshape(64, -1) @ p["w"].T + p["b"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    @jax.jit
    def jax_step(p, x, y):
        loss, grads = jax.value_and_grad(jax_loss)(p, x, y)
        return jax.tree_util.tree_map(lambda a, g: a - lr * g, p, grads), loss

    jp = {name: jnp.asarray(value) for name, value in start.items()}
    jx, jy = jnp.asarray(batch["x"]), jnp.asarray(batch["y"])
    jax_losses = []
    state = jp
    for _ in range(3):
        state, loss = jax_step(state, jx, jy)
        jax_losses.append(float(loss))

    def jax_block():
        import time

        state = jp
        jax_step(state, jx, jy)[1].block_until_ready()
        begin = time.perf_counter()
        for _ in range(block):
            state, loss = jax_step(state, jx, jy)
        loss.block_until_ready()
        return (time.perf_counter() - begin) / block

    systems = {
        "neoflow": lambda: sum(executor.time(feed, block)) / block,
        "torch eager": lambda: torch_block(torch_step, block),
        "jax jit": jax_block,
    }
    tuned = tuned_executor(executor, tune, feed)
    if tuned is not None:
        systems["neoflow tuned"] = lambda: sum(tuned.time(feed, block)) / block
    times = medians(systems, rounds)
    errors = {
        f"loss step {k + 1} vs torch": abs(ours - theirs) / abs(theirs)
        for k, (ours, theirs) in enumerate(zip(losses, torch_losses, strict=True))
    }
    errors |= {
        f"loss step {k + 1} vs jax": abs(ours - theirs) / abs(theirs)
        for k, (ours, theirs) in enumerate(zip(losses, jax_losses, strict=True))
    }
    case = "capsule network training step (capsule28.onnx, batch 64, tf32, fusion neoflow)"
    return {"case": case, "times": times, "errors": errors, "kernels": _kernel_rows(executor, feed)}


def hgemm_case(size: int, rounds: int, block: int) -> dict:
    """hgemm ``size``^3 (fp16 in, fp32 accumulate) against ``torch.matmul``."""
    torch = _torch()
    op = neoflow.op(
        "C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (size, size), "B": (size, size)}, dtype="float16"
    )
    graph = Graph.from_ops([op])
    rng = np.random.default_rng(0)
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float16) for t in graph.inputs}
    executor = CudaExecutor(graph, [op.name], precision="fp16")
    out = executor.run(inputs)[op.name]
    a = torch.tensor(inputs["A"], device="cuda")
    b = torch.tensor(inputs["B"], device="cuda")
    ref = (a.float() @ b.float()).cpu().numpy()
    error = float(np.abs(out.astype(np.float32) - ref).max() / np.abs(ref).max())
    times = medians(
        {"neoflow": lambda: neoflow_block(executor, block), "torch.matmul": lambda: torch_block(lambda: a @ b, block)},
        rounds,
    )
    return {"case": f"hgemm {size}^3", "times": times, "errors": {"C": error}, "kernels": []}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="capsule stride 1 fp16 and hgemm 4096 only")
    parser.add_argument("--only", default=None, help="run only the cases whose name holds this text")
    parser.add_argument("--out", default=None, help="write <out>.md")
    parser.add_argument(
        "--tune",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also time the capsule cases after tuning their kernels on the GPU for up to SECONDS each (0)",
    )
    args = parser.parse_args(argv)
    torch = _torch()
    rounds, block = args.rounds, args.block
    cases = [(1, "fp16")] if args.quick else [(s, p) for s in (1, 2) for p in ("fp16", "tf32")]
    runs = [(f"capsule {s} {p}", lambda s=s, p=p: capsule_case(s, p, rounds, block, args.tune)) for s, p in cases]
    runs.append(("capsule network", lambda: capsule_network_case(rounds, block, args.tune)))
    runs += [
        (f"hgemm {n}", lambda n=n: hgemm_case(n, rounds, max(2, block // 4)))
        for n in ((4096,) if args.quick else (4096, 8192))
    ]
    suite_runs = []
    if not args.quick:
        from benchmarks.gpu_ops import operators

        suite_runs = [(o.name, lambda o=o: operator_case(o, rounds, block)) for o in operators()]
    lines = [f"# neoflow cuda on {torch.cuda.get_device_name()} (torch {torch.__version__})", ""]
    print("\n".join(lines), flush=True)
    results, suite = [], []
    for name, run in [*runs, *suite_runs]:
        if args.only and args.only not in name:
            continue
        print(f"{name} ...", file=sys.stderr, flush=True)
        result = run()
        results.append(result)
        if (name, run) in suite_runs:
            suite.append(result)
        written = case_lines(result)
        print("\n".join(written), flush=True)  # as each case ends: a run cut short keeps what it measured
        lines += written
    summary = summary_lines(results, suite)
    print("\n".join(summary), flush=True)
    lines += summary
    text = "\n".join(lines)
    if args.out:
        Path(f"{args.out}.md").write_text(text + "\n")
        _plot(results, Path(f"{args.out}.png"), torch.cuda.get_device_name())
    return 0


def case_lines(result: dict) -> list[str]:
    """The markdown of one case: its errors against PyTorch, the systems' medians and speed-ups, and
    its ops' predicted against measured times."""
    times = result["times"]
    ours = times["neoflow"]
    lines = [
        f"## {result['case']}",
        "errors against PyTorch (max |diff| / max |ref|): "
        + ", ".join(f"{k} {v:.1e}" for k, v in result["errors"].items()),
        "",
        "| system | median ms | neoflow speed-up |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {name} | {seconds * 1e3:.3f} | {seconds / ours:.2f}x |" for name, seconds in times.items()]
    if result["kernels"]:
        lines += ["", "| op | predicted ms | measured ms |", "| --- | --- | --- |"]
        for name, predicted, measured in result["kernels"]:
            lines.append(f"| {name} | {predicted * 1e3:.3f} | {measured * 1e3:.3f} |")
    return [*lines, ""]


def summary_lines(results: list[dict], suite: list[dict]) -> list[str]:
    """The markdown after the cases: the operator suite's speed-ups and geomean, and the timing model's
    rank correlation over every case's ops."""
    lines = []
    if suite:
        ratios = [r["times"]["torch eager"] / r["times"]["neoflow"] for r in suite]
        geomean = float(np.exp(np.mean(np.log(ratios))))
        lines += [
            "## operator suite (forward + backward, tf32) against PyTorch eager",
            "",
            "| operator | neoflow ms | torch ms | speed-up |",
            "| --- | --- | --- | --- |",
        ]
        for r, ratio in zip(suite, ratios, strict=True):
            t = r["times"]
            lines.append(f"| {r['case']} | {t['neoflow'] * 1e3:.3f} | {t['torch eager'] * 1e3:.3f} | {ratio:.2f}x |")
        lines += [f"\ngeomean {geomean:.2f}x, lowest {min(ratios):.2f}x", ""]
    rows = [row for r in results for row in r["kernels"]]
    if len(rows) >= 3:
        from neoflow.runtime.fusion_report import spearman

        rho = spearman([p for _, p, _ in rows], [m for _, _, m in rows])
        lines.append(f"## tensor-core model: predicted against measured, {len(rows)} ops' kernels")
        lines.append(f"\nSpearman rank correlation {rho:.3f}\n")
    return lines


def _plot(results: list[dict], path: Path, device: str) -> None:
    """Bars of neoflow's speed-up over each peer, case by case (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        (r["case"].split(" (")[0], peer, t / r["times"]["neoflow"])
        for r in results
        for peer, t in r["times"].items()
        if peer != "neoflow"
    ]
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) + 1))
    labels = [f"{case} vs {peer}" for case, peer, _ in rows]
    ratios = [ratio for _, _, ratio in rows]
    ax.barh(range(len(rows)), ratios, color=["tab:green" if r >= 1 else "tab:red" for r in ratios])
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("neoflow speed-up (x, log scale)")
    ax.set_title(f"neoflow cuda on {device}")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
