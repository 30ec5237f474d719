"""Xronos. Layers, bottom up, no import running back (tests/test_layers.py):

- `xronos.contract`: the wire messages, job options, splits, profiles, reports, errors, the MQTT client;
- `xronos.planner`: profiles to a job's layout (cost model, partitioner, pipeline and even plans);
- `edge_node` and `controller`: the device agent with its engine, and the control plane; neither imports the other;
- the front end, the rest of `xronos`: the command line, demo, bench, operator client, broker runners, deploy.
"""

__version__ = "0.1.0"
