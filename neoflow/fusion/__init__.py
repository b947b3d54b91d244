"""Fusion: partition a graph's ops into kernels under a cost model, with pluggable policies."""

from neoflow.fusion.cost import Cost, CostModel, Machine
from neoflow.fusion.patterns import HEAVY, LIGHT, PATTERNS, is_epilogue, kind, pattern
from neoflow.fusion.plan import (
    FusionPlan,
    Kernel,
    PlanError,
    apply_plan,
    kernel_ops,
    plan_from_groups,
    unfused,
    validate,
)
from neoflow.fusion.policies import BUILT_IN, Chimera, Elementwise, FusionPolicy, NeoFlow, NoFusion, load_policy

__all__ = [
    "BUILT_IN",
    "HEAVY",
    "LIGHT",
    "PATTERNS",
    "Chimera",
    "Cost",
    "CostModel",
    "Elementwise",
    "FusionPlan",
    "FusionPolicy",
    "Kernel",
    "Machine",
    "NeoFlow",
    "NoFusion",
    "PlanError",
    "apply_plan",
    "is_epilogue",
    "kernel_ops",
    "kind",
    "load_policy",
    "pattern",
    "plan_from_groups",
    "unfused",
    "validate",
]
