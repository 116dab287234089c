"""Example Strata plugin: registers `CountingRMSNorm` as the out-of-tree override of `RMSNorm`."""

from __future__ import annotations


def register() -> None:
    """Entry point of group `strata.plugins`; Strata calls it once per process at engine start."""
    from strata.custom_op import CustomOp
    from strata_example_plugin.layers import CountingRMSNorm

    CustomOp.register_oot(CountingRMSNorm, name="RMSNorm")
