"""Xronos edge node: the device agent and its tensor-parallel training engine.

Above the contract and the planner (`xronos.contract`, `xronos.planner`, which it uses to re-plan
during a job); never imports `controller`.
"""
