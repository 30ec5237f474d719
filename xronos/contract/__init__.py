"""The contract, the bottom layer: what every other part of Xronos agrees on.

The wire messages and their topics (`wire`), a job's options (`job`), model sizes
and shard splits (`splits`), device profiles as data (`profiles`), the report
(`report`), errors (`errors`), the MQTT client bound to the wire (`mqtt`) and the
metrics endpoint every process serves (`metrics_http`). It imports nothing of
Xronos above it (tests/test_layers.py).
"""
