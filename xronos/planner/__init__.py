"""The planner, above the contract: from device profiles to a job's layout, pure functions.

The cost model and the exact partitioner of uneven tensor parallelism
(`partitioner`), the even split and split rules (`planning`), the pipeline
baseline's stages (`pipeline_plan`), and one job plan for both front ends
(`job_plan`). The node (for re-plans during a job) and the controller both use
it; it imports only the contract (tests/test_layers.py).
"""
