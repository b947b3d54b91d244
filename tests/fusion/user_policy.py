"""A fusion policy written outside neoflow, for the plug-in tests: fuse every
op into the kernel of its first reader when it has exactly one reader."""

from neoflow.fusion import Chimera, Elementwise, FusionPlan, FusionPolicy, plan_from_groups


class FirstReader(FusionPolicy):
    name = "first-reader"

    def plan(self, graph, cost_model) -> FusionPlan:
        group = {op.name: {op.name} for op in graph.ops}
        for op in reversed(graph.ops):
            readers = graph.consumers(op.name)
            if len(readers) == 1 and op.name not in graph.outputs and op.scatter is None:
                merged = group[readers[0].name] | group[op.name]
                for name in merged:
                    group[name] = merged
        unique = {id(g): g for g in group.values()}
        return plan_from_groups(graph, unique.values(), policy=self.name)


#: (target, hardware name) of every plan ``MatrixUnitChains`` made, for the tests
seen_targets: list[tuple[str, str | None]] = []


class MatrixUnitChains(FusionPolicy):
    """Target-aware (the example of docs/fusion-policies.md): Chimera's heavy -> heavy chains where the
    target has a matrix unit (tensor cores, an NPU's cube), element-wise fusion elsewhere."""

    name = "matrix-unit-chains"

    def plan(self, graph, cost_model) -> FusionPlan:
        hardware = cost_model.hardware
        matrix_unit = hardware is not None and any(i.input_dtype == "float16" for i in hardware.intrinsics)
        seen_targets.append((cost_model.target, None if hardware is None else hardware.name))
        return (Chimera() if matrix_unit else Elementwise()).plan(graph, cost_model)


class SameAsNone(FusionPolicy):
    """Exactly ``none``'s plan under another name: two identical plans, for the comparison's noise test."""

    name = "same-as-none"

    def plan(self, graph, cost_model) -> FusionPlan:
        return plan_from_groups(graph, [[op.name] for op in graph.ops], policy=self.name)


NotAPolicy = 42
