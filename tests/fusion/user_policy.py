"""A fusion policy written outside neoflow, for the plug-in tests: fuse every
op into the kernel of its first reader when it has exactly one reader."""

from neoflow.fusion import FusionPlan, FusionPolicy, plan_from_groups


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


NotAPolicy = 42
