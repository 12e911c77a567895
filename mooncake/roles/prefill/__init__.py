"""A prefill node: chunked (pipelined) prefill with pool reuse, KV to the pool and to
the decode node.

- `role`       `run_prefill`: the node, its handlers and loop
- `flow`       one prefill task on a group's leader: begin and finish
- `taskqueue`  the leader's waiting tasks in the Conductor's order
- `handoff`    the prefill side of the KV hand-off to a decode node
- `group/`     the pipeline group: the stage links, a later stage's server and process
"""
