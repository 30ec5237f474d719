"""Xronos edge node: the device agent and its tensor-parallel training engine."""
