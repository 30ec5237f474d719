"""Xronos controller, the control plane: `xronos controller` (service), the node registry and its metrics.

Above the contract and the planner (`xronos.contract`, `xronos.planner`); never imports `edge_node`.
"""
