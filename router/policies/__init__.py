"""Routing policies, one module each behind one protocol (``base.Policy``), found by
name in the registry. ``cost`` is kvplane's policy; the others are the baselines it
is measured against."""

from kvplane.router.policies.base import (
    Decision,
    Options,
    Policy,
    PolicyContext,
    Reason,
    RoutingInput,
    route,
)
from kvplane.router.policies.registry import (
    labelled,
    make_policy,
    options_model,
    policy_names,
    register,
)

__all__ = [
    "Decision",
    "Options",
    "Policy",
    "PolicyContext",
    "Reason",
    "RoutingInput",
    "labelled",
    "make_policy",
    "options_model",
    "policy_names",
    "register",
    "route",
]
