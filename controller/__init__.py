"""Xronos control plane: partition planning (and, later, the MQTT controller)."""
