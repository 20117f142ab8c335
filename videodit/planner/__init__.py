"""The offline memory planner: what a config needs per bucket before anything runs. It
imports no runtime code (only the config, the model definition, the data's bucket tables
and ``parallel.dims``' size arithmetic)."""

from videodit.planner.estimate import Estimate, estimate
from videodit.planner.plan import BucketFit, LatentGeometry, Planner, plan_buckets, planner_from_config

__all__ = ["BucketFit", "Estimate", "LatentGeometry", "Planner", "estimate", "plan_buckets", "planner_from_config"]
