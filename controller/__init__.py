"""Xronos controller, the control plane: `xronos controller` (`service`), the node registry (`registry`),
the jobs it tracks and their rules (`jobs`), one live controller per broker (`leader`), and its metrics.

Above the contract and the planner (`xronos.contract`, `xronos.planner`); never imports `edge_node`.
"""
